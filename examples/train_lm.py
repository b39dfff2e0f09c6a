"""Train a small byte-level language model on the standard library's own source code.

The data is the ``.py`` files of the Python standard library: every machine with Python has
them. Worker processes read them with ``aiofiles`` (an async reader), cut them into chunks of
bytes, bucket the chunks by length and pad them into batches. The training loop consumes the
batches with ``async for``; the same event loop runs a periodic evaluation on held-out files
(its own loader, in its own task) and writes checkpoints asynchronously. At the end it says
how long training waited for data.

    python examples/train_lm.py                 # about a minute on 2 CPU cores
    python examples/train_lm.py --device cuda --steps 2000 --workers 4
    AIOLOADER_SMOKE=1 python examples/train_lm.py   # a few batches, to check the setup
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import os
import sysconfig
import tempfile
import time
import zlib

import aiofiles
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import aioloader

SMOKE = os.environ.get("AIOLOADER_SMOKE") == "1"
SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ------------------------------------------------------------------------------------ data


def stdlib_files(split: str, max_files: int) -> list[str]:
    """The standard library's .py files: "train" or the held-out "eval" split (1 in 10)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        # Installed packages and the test suite are not the standard library's code.
        subfolders[:] = sorted(d for d in subfolders if d not in SKIP)
        for name in sorted(names):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)
                held_out = zlib.crc32(rel.encode()) % 10 == 0  # stable, unlike hash()
                if held_out == (split == "eval"):
                    files.append(os.path.join(root, rel))
    return files[:max_files]


class SourceChunks(aioloader.Reader):
    """Chunks of up to ``chunk_size`` bytes of each file, read with aiofiles.

    The reader shards by file itself (``manual_multiprocess_sharding``): worker k of n reads
    files k, k + n, ... rather than every worker reading everything.
    """

    manual_multiprocess_sharding = True

    def __init__(self, chunk_size: int = 128) -> None:
        self.chunk_size = chunk_size

    async def read(self, files: list[str]):
        info = aioloader.get_worker_info()
        if info is not None:
            files = files[info.id :: info.num_workers]
        for path in files:
            async with aiofiles.open(path, "rb") as f:
                data = await f.read()
            for start in range(0, len(data), self.chunk_size):
                chunk = data[start : start + self.chunk_size]
                if len(chunk) > 1:
                    tokens = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
                    yield {"tokens": tokens, "length": len(chunk)}


def make_loader(files: list[str], *, batch_size: int, workers: int,
                **options) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        SourceChunks(),
        files,
        batch_sampler=aioloader.BucketBatchSampler(batch_size, sorting_keys=["tokens"]),
        collate_fn=aioloader.PadCollate(pad_value=0),
        num_workers=workers,
        quiet=True,  # this script draws its own progress bar (when stderr is a terminal)
        seed=0,
        **options,
    )


# ----------------------------------------------------------------------------------- model


class ByteGRU(nn.Module):
    """Predicts the next byte from the previous ones."""

    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean next-byte cross-entropy over the real (unpadded) positions of the batch."""
    tokens = batch["tokens"].long()
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    positions = torch.arange(1, tokens.shape[1], device=tokens.device)
    targets[positions >= batch["length"][:, None]] = -100  # padding: no loss
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), ignore_index=-100)


# ------------------------------------------------------------------------ background tasks


async def evaluate(loader: aioloader.DataLoader, model: nn.Module, step: int) -> float:
    """Mean loss of ``model`` (a frozen copy) over the held-out split.

    The forward passes run in a thread, off the event loop; ``no_grad`` is per thread, so it
    goes inside that thread.
    """

    def batch_loss(batch: dict) -> float:
        with torch.no_grad():
            return lm_loss(model, batch).item()

    losses = [await asyncio.to_thread(batch_loss, batch) async for batch in loader]
    loss = sum(losses) / len(losses)
    tqdm.write(f"step {step:5d}  eval loss  {loss:.3f}  ({len(losses)} held-out batches)")
    return loss


def serialize(model: nn.Module, step: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict()}, buffer)
    return buffer.getvalue()


async def save_checkpoint(data: bytes, path: str) -> None:
    """Write with aiofiles (a thread does the blocking I/O), then rename: never half a file."""
    async with aiofiles.open(path + ".tmp", "wb") as f:
        await f.write(data)
    os.replace(path + ".tmp", path)


# -------------------------------------------------------------------------------- training


async def train(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    train_files = stdlib_files("train", args.max_files)
    eval_files = stdlib_files("eval", max(2, args.max_files // 25))
    print(f"{len(train_files)} training files, {len(eval_files)} held-out files, "
          f"{args.workers} workers, device {device}")

    # Lazy mode: workers stream, bucketing 2048 chunks at a time; an "epoch" is --steps
    # batches, and the stream starts over at the end of the files.
    train_loader = make_loader(train_files, batch_size=args.batch_size, workers=args.workers,
                               max_instances_in_memory=2048, batches_per_epoch=args.steps)
    # Cached mode: the held-out chunks are read once, then every evaluation reuses them.
    eval_loader = make_loader(eval_files, batch_size=64, workers=0)
    if device.type != "cpu":
        train_loader.set_target_device(device)
        eval_loader.set_target_device(device)

    torch.manual_seed(0)
    model = ByteGRU().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def train_step(batch: dict) -> float:
        loss = lm_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    losses: list[float] = []
    waited = 0.0  # time the training loop spent awaiting its next batch
    evaluation: asyncio.Task | None = None  # at most one of each in flight
    checkpoint: asyncio.Task | None = None
    async with train_loader, eval_loader:
        # Drawn where the loader would draw its own (quiet=None): a terminal or a notebook,
        # not a log file, where a bar's redraws would pile up.
        bar = tqdm(total=args.steps, desc="training", unit="batch",
                   disable=not aioloader.shows_bars(None))
        started = ready = time.perf_counter()
        async for batch in train_loader:
            waited += time.perf_counter() - ready
            # The step runs in a thread (torch releases the GIL in its kernels), so that
            # the event loop stays free for the evaluation and checkpoint tasks meanwhile.
            loss = await asyncio.to_thread(train_step, batch)
            losses.append(loss)
            step = len(losses)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if step == 1 or step % args.log_every == 0:
                tqdm.write(f"step {step:5d}  train loss {loss:.3f}")
            if step % args.eval_every == 0 and step < args.steps:  # the last one comes below
                # Snapshots are taken here, between steps, so that no task sees the weights
                # change under it.
                if evaluation is None or evaluation.done():  # a loader runs one epoch at a time
                    snapshot = copy.deepcopy(model).eval()
                    evaluation = asyncio.create_task(evaluate(eval_loader, snapshot, step))
                if checkpoint is None or checkpoint.done():
                    data = serialize(model, step)
                    checkpoint = asyncio.create_task(save_checkpoint(data, args.checkpoint))
            ready = time.perf_counter()
        elapsed = time.perf_counter() - started
        bar.close()
        await asyncio.gather(*(t for t in (evaluation, checkpoint) if t is not None))
        final_loss = await evaluate(eval_loader, copy.deepcopy(model).eval(), len(losses))
    await save_checkpoint(serialize(model, len(losses)), args.checkpoint)

    first = sum(losses[:10]) / len(losses[:10])
    last = sum(losses[-10:]) / len(losses[-10:])
    print(f"train loss: first {first:.3f} -> last {last:.3f}"
          f" ({'decreased' if last < first else 'did not decrease'}); eval loss {final_loss:.3f}")
    print(f"waited for data {waited:.2f} s of {elapsed:.2f} s "
          f"({100 * waited / elapsed:.1f} %), {len(losses) / elapsed:.1f} batches/s")
    print(f"checkpoint: {args.checkpoint}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12 if SMOKE else 300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--max-files", type=int, default=20 if SMOKE else 300)
    parser.add_argument("--eval-every", type=int, default=6 if SMOKE else 100)
    parser.add_argument("--log-every", type=int, default=4 if SMOKE else 50)
    parser.add_argument("--checkpoint",
                        default=os.path.join(tempfile.gettempdir(), "aioloader_lm.pt"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # small model: one thread is as fast, and never oversubscribes
    asyncio.run(train(args))


if __name__ == "__main__":
    main()
