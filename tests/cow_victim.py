"""Copy-on-access (torch issue 13246), run by test_recycling in a subprocess.

A dataset holds ~200 MB of Python objects built before the workers fork; every sample
reads a slice of them, and Python's refcounts turn each page it touches into the worker's
own copy. Prints JSON: the largest private memory (USS) seen in any worker, in MB.

    python cow_victim.py MAX_WORKER_RSS_MB   (0: no limit)
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset

import aioloader

OBJECTS = 6_000_000  # ~32 bytes each in the list: ~200 MB
SAMPLES = 96


class Floats(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.values = [float(i) for i in range(OBJECTS)]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        step = OBJECTS // SAMPLES
        return torch.tensor(sum(self.values[i * step:(i + 1) * step]))  # touches them all


def main() -> None:
    limit_mb = int(sys.argv[1])
    dataset = Floats()
    # The parent's own full collections write to every tracked object's header, and each
    # page they touch turns private in every forked worker: tens of MB when that happens
    # right after a fork (its timing depends on allocations). That is not the growth this
    # measures; frozen objects are never collected, so the parent leaves them alone.
    gc.freeze()
    loader = aioloader.DataLoader(dataset, batch_size=4, num_workers=2, quiet=True,
                                  max_worker_rss=limit_mb << 20 if limit_mb else None)
    me = psutil.Process()
    peak = 0.0
    seen: list[float] = []
    for batch in loader:
        seen.append(float(batch.sum()))
        for child in me.children():
            try:
                peak = max(peak, child.memory_full_info().uss / 2**20)
            except psutil.Error:
                pass  # retired meanwhile
    stats: Any = loader.stats()
    loader.close()
    expected = float(sum(range(OBJECTS - OBJECTS % SAMPLES)))
    print(json.dumps({"peak_uss_mb": peak, "recycles": stats.recycles,
                      "exact": abs(sum(seen) - expected) < 1e-3 * expected,
                      "batches": len(seen)}))


if __name__ == "__main__":
    main()
