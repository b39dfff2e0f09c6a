"""Module-level sources for test_resume (spawned workers pickle them by reference)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import aioloader


def item(i: int) -> dict[str, Any]:
    """Instance ``i``: its index, a tensor, and a length that varies (for bucketing)."""
    return {"i": i, "x": torch.tensor([i, -i]), "tokens": "t" * (i % 7 + 1)}


class Items(Dataset[dict[str, Any]]):
    """Map-style; counts ``__getitem__`` calls made in this process."""

    calls = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        Items.calls += 1
        return item(i)


class SyncReader(aioloader.Reader):
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: Any) -> Any:
        for i in range(self.n):
            yield item(i)


class AsyncReader(aioloader.Reader):
    def __init__(self, n: int) -> None:
        self.n = n

    async def read(self, data_path: Any) -> Any:
        for i in range(self.n):
            if i % 5 == 0:
                await asyncio.sleep(0)
            yield item(i)


class StatefulReader(aioloader.Reader):
    """Knows its own position: a resume starts reading there. ``started_at`` records where
    each read in this process began (an O(1) resume starts where it left off)."""

    started_at: list[int] = []

    def __init__(self, n: int) -> None:
        self.n = n
        self._pos = 0
        self._load: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load = int(state["next"])

    def read(self, data_path: Any) -> Any:
        start, self._load = self._load or 0, None
        StatefulReader.started_at.append(start)
        for i in range(start, self.n):
            self._pos = i + 1
            yield item(i)


class Stream(IterableDataset[dict[str, Any]]):
    """An IterableDataset that splits itself across torch's workers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        k, count = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, self.n, count):
            yield item(i)
