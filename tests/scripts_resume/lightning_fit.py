"""Lightning's ``Trainer.fit`` over the loader under test, recording the indices of every step.

One run (``run`` subcommand) fits a tiny model for 2 epochs over ``Indexed``, a map-style
dataset whose samples carry their index, shuffled with a fixed seed, and appends one JSON
line per training step to ``--log``: ``{"epoch", "step", "batch_idx", "i": [indices]}``.
With ``--max-steps S --every K`` it stops after step S, having saved a checkpoint every K
steps (``mid/step=K.ckpt``, ...), one at the last batch of the first epoch
(``boundary/step=L.ckpt``, L = batches per epoch) and one when that epoch ends
(``epoch_end/step=L.ckpt``); with ``--resume CKPT`` it continues a run
from that checkpoint to the end of epoch 2.

The ``scenario`` subcommand is what tests/test_lightning_resume.py runs: it imports
Lightning once (seconds) and then forks one child per run, each in a process group of its
own, so that every run starts from a fresh process with no loader or trainer in it:

    full             2 epochs, no checkpoint
    interrupted      stops after step 18 (mid epoch 1); checkpoints at 6, 12, 18, at 13
                     (= L, the last batch of epoch 0) and at the end of epoch 0
    resume_mid       from step=18: the rest of epoch 1
    resume_early     from step=6 (mid epoch 0): written before the run went on to step 18
    resume_epoch     from the boundary checkpoint (on_train_batch_end of epoch 0's last batch)
    resume_epoch_end from the end-of-epoch checkpoint (on_train_epoch_end of epoch 0)

Each ``--config LOADER:WORKERS`` gets a folder ``WORKDIR/LOADER-wWORKERS`` with the logs,
the checkpoints and ``summary.json`` (per run: exit status, seconds, processes left behind);
the test compares the logs.

Examples:
    python tests/scripts_resume/lightning_fit.py scenario --config aioloader:2 \
        --config torchdata:2 --workdir /tmp/resume
    python tests/scripts_resume/lightning_fit.py run --loader torchdata --log full.jsonl \
        --workdir /tmp/resume
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import select
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from aioloader.testing import members

N_ITEMS = 100
BATCH_SIZE = 8
BATCHES_PER_EPOCH = -(-N_ITEMS // BATCH_SIZE)  # 13: the last batch holds 4
EPOCHS = 2
SEED = 1234
EVERY = 6  # mid-epoch checkpoints at steps 6, 12, 18
STOP_AT = 18  # epoch 1, batch_idx 5
RUN_DEADLINE = 120.0  # seconds one forked run may take


class Indexed(Dataset[dict[str, Any]]):
    """``{"i": idx, "x": 4 floats}``: cheap samples that say which index they are."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return {"i": idx, "x": torch.full((4,), idx / self.n)}


def make_loader(kind: str, num_workers: int) -> Any:
    """The loader under test, built the same way in every run."""
    if kind == "aioloader":
        import aioloader

        return aioloader.DataLoader(Indexed(N_ITEMS), batch_size=BATCH_SIZE, shuffle=True,
                                    seed=SEED, num_workers=num_workers, quiet=True)
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator()
    generator.manual_seed(SEED)
    return StatefulDataLoader(Indexed(N_ITEMS), batch_size=BATCH_SIZE, shuffle=True,
                              generator=generator, num_workers=num_workers)


def run(args: argparse.Namespace) -> None:
    """One ``Trainer.fit``: see the module docstring."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.log_file = open(args.log, "a")  # noqa: SIM115 - closed in on_fit_end

        def train_dataloader(self) -> Any:
            return make_loader(args.loader, args.num_workers)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            line = {"epoch": self.current_epoch, "step": self.global_step,
                    "batch_idx": batch_idx, "i": batch["i"].tolist()}
            self.log_file.write(json.dumps(line) + "\n")
            self.log_file.flush()
            return self.layer(batch["x"]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_fit_end(self) -> None:
            self.log_file.close()

    workdir = Path(args.workdir)
    callbacks: list[Any] = []
    if args.every:
        callbacks = [
            ModelCheckpoint(dirpath=workdir / "mid", filename="{step}",
                            every_n_train_steps=args.every, save_top_k=-1),
            ModelCheckpoint(dirpath=workdir / "boundary", filename="{step}",
                            every_n_train_steps=BATCHES_PER_EPOCH, save_top_k=-1),
            ModelCheckpoint(dirpath=workdir / "epoch_end", filename="{step}",
                            every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1),
        ]
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS,
        max_steps=args.max_steps if args.max_steps else -1,
        deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks),
        callbacks=callbacks, num_sanity_val_steps=0, default_root_dir=workdir)
    trainer.fit(Recorder(), ckpt_path=args.resume)


# ------------------------------------------------------------------------------- scenario

def scenario_runs(workdir: Path) -> list[tuple[str, list[str]]]:
    """The runs of the scenario, in order, as ``run`` arguments."""
    mid, boundary, epoch_end = workdir / "mid", workdir / "boundary", workdir / "epoch_end"
    return [
        ("full", []),
        ("interrupted", ["--every", str(EVERY), "--max-steps", str(STOP_AT)]),
        ("resume_mid", ["--resume", str(mid / f"step={STOP_AT}.ckpt")]),
        ("resume_early", ["--resume", str(mid / f"step={EVERY}.ckpt")]),
        ("resume_epoch", ["--resume", str(boundary / f"step={BATCHES_PER_EPOCH}.ckpt")]),
        ("resume_epoch_end", ["--resume", str(epoch_end / f"step={BATCHES_PER_EPOCH}.ckpt")]),
    ]


def scenario(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Every run of the scenario for each ``--config``, into ``WORKDIR/LOADER-wN/``."""
    import lightning.pytorch  # noqa: F401 - once, here, before the forks

    failed = False
    for config in args.config:
        loader, _, workers = config.partition(":")
        workdir = Path(args.workdir) / f"{loader}-w{workers}"
        workdir.mkdir(parents=True, exist_ok=True)
        common = ["--loader", loader, "--num-workers", workers, "--workdir", str(workdir)]
        summary: dict[str, Any] = {"batches_per_epoch": BATCHES_PER_EPOCH, "every": EVERY,
                                   "stop_at": STOP_AT, "runs": {}}
        broken = False
        for name, extra in scenario_runs(workdir):
            log = workdir / f"{name}.jsonl"
            run_args = parser.parse_args(["run", *common, "--log", str(log), *extra])
            if broken:
                summary["runs"][name] = {"skipped": "an earlier run failed"}
                continue
            result = forked(run, run_args, RUN_DEADLINE)
            summary["runs"][name] = result
            broken = result["status"] != "ok"
            print(f"{config} {name}: {result['status']} in {result['seconds']:.1f} s",
                  file=sys.stderr, flush=True)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
        failed |= broken
    return 1 if failed else 0


def forked(fn: Any, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """``fn(args)`` in a forked child in its own process group; its outcome as a dict.

    The child reports its traceback through a pipe. Processes it leaves in its group
    (workers of a loader nobody closed) get 10 s to go by themselves, then are killed and
    listed under ``leftover_pids``.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child(fn, args, read_fd, write_fd)
    os.close(write_fd)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # the child does it too: whichever runs first
    try:
        error, timed_out = _read_until_eof(read_fd, started + deadline)
    finally:
        os.close(read_fd)
    if timed_out:
        _kill_group(pid)
    _, status = os.waitpid(pid, 0)
    leftovers = _reap_group(pid)
    result: dict[str, Any] = {"seconds": time.monotonic() - started,
                              "leftover_pids": leftovers}
    if timed_out:
        result.update(status="timeout", error=f"ran past {deadline:.0f} s; killed")
    elif error:
        result.update(status="error", error=error)
    elif status != 0:
        result.update(status="died", error=f"wait status {status}")
    else:
        result["status"] = "ok"
    return result


def _child(fn: Any, args: argparse.Namespace, read_fd: int,
           write_fd: int) -> None:  # pragma: no cover - the child
    code = 0
    try:
        os.close(read_fd)
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            fn(args)
            gc.collect()  # the run's loader goes as a dropped loader goes: nobody closes it
        except BaseException:  # noqa: BLE001 - reported through the pipe
            data = traceback.format_exc().encode()
            while data:
                data = data[os.write(write_fd, data):]
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # none of the parent's atexit handlers run twice


def _read_until_eof(fd: int, deadline: float) -> tuple[str, bool]:
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks).decode(errors="replace"), True
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks).decode(errors="replace"), False
            chunks.append(chunk)


def _reap_group(pgid: int, grace: float = 10.0) -> list[int]:
    first = members(group=pgid)
    deadline = time.monotonic() + grace
    left = first
    while left and time.monotonic() < deadline:
        time.sleep(0.1)  # processes we did not start and cannot wait on: look again
        left = members(group=pgid)
    if left:
        _kill_group(pgid)
    return first if left else []


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# ----------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one fit, in this process")
    one.add_argument("--loader", choices=("aioloader", "torchdata"), required=True)
    one.add_argument("--num-workers", type=int, default=0)
    one.add_argument("--workdir", required=True, help="checkpoints go here")
    one.add_argument("--log", required=True, help="JSON lines, one per training step")
    one.add_argument("--every", type=int, default=0, help="checkpoint every N steps")
    one.add_argument("--max-steps", type=int, default=0)
    one.add_argument("--resume", default=None, metavar="CKPT")
    many = commands.add_parser("scenario", help="every run, each in a forked child")
    many.add_argument("--config", action="append", required=True, metavar="LOADER:WORKERS",
                      help="e.g. aioloader:2 (repeatable)")
    many.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.command == "scenario":
        return scenario(args, parser)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
