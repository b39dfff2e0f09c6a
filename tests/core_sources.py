"""Module-level sources for the core tests (spawned workers must be able to import them)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

import aioloader


def instance(i: int) -> dict[str, Any]:
    info = aioloader.get_worker_info()
    return {"index": i, "x": torch.tensor([i, i * 2]), "pid": os.getpid(),
            "wid": -1 if info is None else info.id}


class SyncReader(aioloader.Reader):
    def __init__(self, n: int, sleep: float = 0.0) -> None:
        self.n, self.sleep = n, sleep

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            if self.sleep:
                time.sleep(self.sleep)
            yield instance(i)


class AsyncReader(aioloader.Reader):
    def __init__(self, n: int, sleep: float = 0.0) -> None:
        self.n, self.sleep = n, sleep

    async def read(self, data_path: Any) -> AsyncIterator[dict[str, Any]]:
        for i in range(self.n):
            await asyncio.sleep(self.sleep)
            yield instance(i)


class Squares(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "sq": torch.tensor(float(i * i))}


class Payload(Dataset[torch.Tensor]):
    """Batches of a known size, for the arena tests."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.numel,), i, dtype=torch.int32)


class Growing(Dataset[torch.Tensor]):
    """Each sample bigger than the last: the arena must grow, batches stay intact."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4 ** (i // 2 + 1) * 64,), i, dtype=torch.int64)


class Uncollatable(aioloader.Reader):
    def read(self, data_path: Any) -> Iterator[Any]:
        yield {"index": 0, "thing": object()}
        yield {"index": 1, "thing": object()}


class Draws(aioloader.Reader):
    """What a worker's random generators give, and its WorkerInfo, per instance."""

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        import random

        import numpy as np

        info = aioloader.get_worker_info()
        for i in range(4):
            yield {"index": i, "wid": -1 if info is None else info.id,
                   "seed": -1 if info is None else info.seed,
                   "py": random.random(), "np": float(np.random.rand()),
                   "torch": float(torch.rand(1))}


class BigInstances(aioloader.Reader):
    """Instances whose chunks are large enough to be leased, were they not cached."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield {"index": i, "x": torch.full((self.numel,), float(i))}


class Niceness(Dataset[dict[str, int]]):
    """Each sample says the niceness and pid of the process that read it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"nice": os.nice(0), "pid": os.getpid()}
