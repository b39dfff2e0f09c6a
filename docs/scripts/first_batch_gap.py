"""Time to the first batch when a script sets up for 3 s between ``DataLoader(...)`` and its
first batch (building a model, say).

    python docs/scripts/first_batch_gap.py aio|torch spawn|forkserver|fork

docs/performance.md quotes it (issue 13's "first batch with spawn").
"""

from __future__ import annotations

import sys
import time

import torch

import aioloader
from aioloader.bench._workloads import WORKLOADS

SET_UP = 3.0  # seconds of the script's own work between the two


def main(side: str, method: str) -> None:
    workload = WORKLOADS["tiny"]
    dataset = workload.dataset(64 * 20)
    began = time.perf_counter()
    loader: aioloader.DataLoader | torch.utils.data.DataLoader[object]
    if side == "aio":
        loader = aioloader.DataLoader(dataset, batch_size=64, num_workers=2,
                                      start_method=method, quiet=True)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=2,
                                             multiprocessing_context=method)
    x = torch.randn(512, 512)  # the script's set-up: work on the main thread
    while time.perf_counter() - began < SET_UP:
        x = (x @ x).tanh()
    asked = time.perf_counter()
    next(iter(loader))
    print(f"{side} {method}: first batch {(time.perf_counter() - asked) * 1e3:.0f} ms "
          f"after {SET_UP:.0f} s of set-up")
    if isinstance(loader, aioloader.DataLoader):
        loader.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
