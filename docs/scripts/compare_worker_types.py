"""Process or thread workers? The same batches through both, alternating runs (docs/performance.md).

    python docs/scripts/compare_worker_types.py [--runs 3] [--batches 40] [--workers 2]
                                                [--torch-threads N]

Three workloads, each a map-style dataset of 64-sample batches:

* ``decode``: a 224x224 JPEG decoded with Pillow per sample (Pillow releases the GIL while
  it decodes), uint8[64, 3, 224, 224] batches (9.6 MB);
* ``torch-ops``: a small convolution and matmuls per sample (torch releases the GIL),
  float32[64, 3, 128, 128] batches (12.6 MB);
* ``python``: pure-Python work per sample (a tokenizer-like loop that holds the GIL),
  int64[64, 256] batches (128 KB).

Then the time from a fresh loader to its first batch: fork, spawn, thread.

Each run is a fresh loader in a fresh process: one warm-up epoch, then the timed one.
``--torch-threads N`` calls ``torch.set_num_threads(N)`` there first: thread workers share
the process's intra-op pool (process workers always run with one thread).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.utils.data as tud
from PIL import Image

BATCH = 64


class Decode(tud.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        pixels = (rng.random((224, 224, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        self.jpeg, self.n = buf.getvalue(), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        img = Image.open(io.BytesIO(self.jpeg)).convert("RGB")
        return torch.from_numpy(np.array(img)).permute(2, 0, 1)


class TorchOps(tud.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.kernel = torch.randn(3, 3, 5, 5)
        self.mix = torch.randn(128, 128)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(1, 3, 128, 128, generator=g)
        x = torch.nn.functional.conv2d(x, self.kernel, padding=2)[0]
        for _ in range(4):
            x = torch.tanh(x @ self.mix)
        return x


class PurePython(tud.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.text = " ".join(f"word{i % 97}" for i in range(2000))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = [sum(map(ord, w)) % 30000 for w in self.text.split()][:256]
        return torch.tensor(ids)


WORKLOADS: dict[str, type[tud.Dataset[torch.Tensor]]] = {
    "decode": Decode, "torch-ops": TorchOps, "python": PurePython}


def one_run(workload: str, worker_type: str, batches: int, workers: int) -> float:
    """Batches per second of one timed epoch, after a warm-up epoch (in this process)."""
    import aioloader

    dataset = WORKLOADS[workload](batches * BATCH)
    with aioloader.DataLoader(dataset, batch_size=BATCH, num_workers=workers, quiet=True,
                              worker_type=worker_type) as loader:
        for _ in loader:
            pass
        began = time.perf_counter()
        count = sum(1 for _ in loader)
        return count / (time.perf_counter() - began)


class Tiny(tud.Dataset[int]):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> int:
        return i


def first_batch(worker_type: str, workers: int) -> float:
    """Milliseconds from a fresh loader to its first batch (``process`` is fork, the
    default; ``spawn`` is a process worker started with spawn)."""
    import aioloader

    began = time.perf_counter()
    method = "spawn" if worker_type == "spawn" else "fork"
    with aioloader.DataLoader(Tiny(), batch_size=64, num_workers=workers, quiet=True,
                              start_method=method,
                              worker_type="thread" if worker_type == "thread" else "process"
                              ) as loader:
        next(iter(loader))
        return (time.perf_counter() - began) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # workload:worker_type, in a child
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.one:
        workload, worker_type = args.one.split(":")
        if workload == "first":
            print(json.dumps(first_batch(worker_type, args.workers)))
        else:
            print(json.dumps(one_run(workload, worker_type, args.batches, args.workers)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{args.workers} workers, {args.batches} batches of {BATCH}, {args.runs} runs each")
    for workload in args.workloads.split(","):
        rates: dict[str, list[float]] = {"process": [], "thread": []}
        for _ in range(args.runs):
            for worker_type in rates:  # alternating: drift hits both alike
                out = subprocess.run(
                    [sys.executable, __file__, "--one", f"{workload}:{worker_type}",
                     "--batches", str(args.batches), "--workers", str(args.workers),
                     "--torch-threads", str(args.torch_threads)],
                    check=True, capture_output=True, text=True).stdout
                rates[worker_type].append(json.loads(out.strip().splitlines()[-1]))
        cells = {k: f"{statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})"
                 for k, v in rates.items()}
        ratio = statistics.median(rates["thread"]) / statistics.median(rates["process"])
        print(f"{workload:10s} batches/s  process {cells['process']}   "
              f"thread {cells['thread']}   thread/process {ratio:.2f}x")
    first: dict[str, list[float]] = {"process": [], "spawn": [], "thread": []}
    for _ in range(args.runs):
        for worker_type in first:
            out = subprocess.run(
                [sys.executable, __file__, "--one", f"first:{worker_type}",
                 "--workers", str(args.workers)], check=True, capture_output=True,
                text=True).stdout
            first[worker_type].append(json.loads(out.strip().splitlines()[-1]))
    print("first batch, ms (fresh loader): " + ", ".join(
        f"{k if k != 'process' else 'fork'} {statistics.median(v):.0f}"
        for k, v in first.items()))


if __name__ == "__main__":
    main()
