"""Module-level readers, datasets and collates for the fault tests (spawn can pickle them)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

import aioloader


def explode_in_collate(batch: list[Any]) -> Any:
    """A collate that raises on its second batch."""
    if any(item["index"] >= 4 for item in batch):
        raise ValueError(f"explode_in_collate: bad batch at {time.time()!r}")
    return aioloader.default_collate(batch)


def collate_returns_lambda(batch: list[Any]) -> Any:
    return {"index": torch.tensor([b["index"] for b in batch]), "fn": lambda: None}


def _gen() -> Any:
    yield 1


def collate_returns_generator(batch: list[Any]) -> Any:
    return _gen()


class ExplodingReader(aioloader.Reader):
    """Raises from a function whose name the test looks for in the worker traceback."""

    def __init__(self, n: int, fail_at: int) -> None:
        self.n = n
        self.fail_at = fail_at

    def read(self, data_path: Any = None) -> Any:
        for i in range(self.n):
            if i == self.fail_at:
                explode_in_read(i)
            yield {"index": i}


def explode_in_read(i: int) -> None:
    raise KeyError(f"explode_in_read: instance {i} at {time.time()!r}")


class AsyncExplodingReader(ExplodingReader):
    async def read(self, data_path: Any = None) -> Any:  # type: ignore[override]
        for i in range(self.n):
            if i == self.fail_at:
                explode_in_async_read(i)
            yield {"index": i}


def explode_in_async_read(i: int) -> None:
    raise KeyError(f"explode_in_async_read: instance {i} at {time.time()!r}")


class Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset of ``{"index": i, "x": zeros(width)}``."""

    def __init__(self, n: int, width: int = 4) -> None:
        self.n = n
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "x": torch.zeros(self.width)}


class PlainReader(aioloader.Reader):
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: Any = None) -> Any:
        for i in range(self.n):
            yield {"index": i}


class UnpicklableReader(PlainReader):
    """Holds a lock: fine with fork, impossible to send to a spawned worker."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


class StartsMarker(PlainReader):
    """Writes a marker file when a worker starts reading (to prove none started)."""

    def __init__(self, n: int, marker: str) -> None:
        super().__init__(n)
        self.marker = marker
        self.lock = threading.Lock()

    def read(self, data_path: Any = None) -> Any:
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        yield from super().read(data_path)


class Shards(aioloader.Reader):
    """Shards itself by instance file: ``shards`` files, each worker reads its own files."""

    manual_multiprocess_sharding = True

    def __init__(self, shards: int, per_shard: int) -> None:
        self.shards = shards
        self.per_shard = per_shard

    def read(self, data_path: Any = None) -> Any:
        info = aioloader.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for shard in range(wid, self.shards, nw):
            for j in range(self.per_shard):
                yield {"index": shard * self.per_shard + j}


class BigBatches(aioloader.Reader):
    """Instances of ``mb`` MiB each (uint8), for the small-/dev/shm test."""

    def __init__(self, n: int, mb: int) -> None:
        self.n = n
        self.mb = mb

    def read(self, data_path: Any = None) -> Any:
        for i in range(self.n):
            yield {"index": i, "x": torch.full((self.mb << 20,), i % 251, dtype=torch.uint8)}


class BigDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, mb: int) -> None:
        self.n = n
        self.mb = mb

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "x": torch.full((self.mb << 20,), i % 251, dtype=torch.uint8)}


class Stalls(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Map-style; from instance ``stall_from`` on, ``__getitem__`` says so (its pid, a line
    on the FIFO ``report``) and then blocks for an hour, deaf to EOF: user code the worker's
    loop cannot interrupt (issue 19)."""

    def __init__(self, n: int, stall_from: int, report: str) -> None:
        self.n = n
        self.stall_from = stall_from
        self.report = report

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i >= self.stall_from:
            fd = os.open(self.report, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(fd)
            time.sleep(3600)
        return {"index": i}


class GatedReader(PlainReader):
    """Only worker 0's first batch (instances 0 and 2 of a 2-worker shard) comes at once;
    each worker then reads one byte from the pipe ``gate`` (inherited by fork) before
    going on: until the test writes them, the consumer's next batch is truly awaited."""

    def __init__(self, n: int, gate: int) -> None:
        super().__init__(n)
        self.gate = gate

    def read(self, data_path: Any = None) -> Any:
        info = aioloader.get_worker_info()
        first = 3 if info is not None and info.id == 0 else 0
        for i in range(self.n):
            if i == first:
                os.read(self.gate, 1)
            yield {"index": i}
