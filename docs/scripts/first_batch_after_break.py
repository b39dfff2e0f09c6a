"""The first batch of an epoch that follows one left early (``break``), with persistent workers,
against torch's DataLoader; and after a completed epoch, for comparison.

    python docs/scripts/first_batch_after_break.py [PAIRS]

Each run is a fresh process (aioloader and torch in turn, PAIRS of each): 2 workers, fork, the
bench's tiny workload (64 x int64[128] a batch), one whole epoch to warm up, then 5 epochs
broken after 3 batches and 5 whole ones; each epoch's ``iter()`` to its first batch is timed.
docs/migrating.md and issue 32's note quote it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import aioloader
from aioloader.bench._workloads import WORKLOADS

EPOCHS = 5


def one_run(side: str) -> dict[str, list[float]]:
    dataset = WORKLOADS["tiny"].dataset(64 * 40)
    loader: Any
    if side == "aio":
        loader = aioloader.DataLoader(dataset, 64, num_workers=2, persistent_workers=True)
    else:
        loader = torch.utils.data.DataLoader(dataset, 64, num_workers=2,
                                             persistent_workers=True)
    for _ in loader:  # warm: the workers started, the first plan made
        pass
    times: dict[str, list[float]] = {"after_break": [], "after_full": []}
    for kind, stop in (("after_break", 3), ("after_full", None)):
        for _ in range(EPOCHS):
            began = time.perf_counter()
            for i, _batch in enumerate(loader):
                if i == 0:
                    times[kind].append((time.perf_counter() - began) * 1e3)
                if stop is not None and i + 1 == stop:
                    break
    if side == "aio":
        loader.close()
    return times


def main(pairs: int) -> None:
    runs: dict[str, dict[str, list[float]]] = {
        side: {"after_break": [], "after_full": []} for side in ("aio", "torch")}
    for _ in range(pairs):
        for side in ("aio", "torch"):
            out = subprocess.run([sys.executable, __file__, "--one", side], check=True,
                                 capture_output=True, text=True).stdout
            for kind, values in json.loads(out.splitlines()[-1]).items():
                runs[side][kind].extend(values)
    print(f"first batch of an epoch, ms (median, p90 over {pairs} runs x {EPOCHS} epochs)")
    print(f"{'':14}{'aioloader':>20}{'torch':>20}")
    for kind in ("after_break", "after_full"):
        cells = []
        for side in ("aio", "torch"):
            values = sorted(runs[side][kind])
            p90 = values[int(0.9 * (len(values) - 1))]
            cells.append(f"{statistics.median(values):8.2f} / {p90:8.2f}")
        print(f"{kind:14}{cells[0]:>20}{cells[1]:>20}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one_run(sys.argv[2])))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
