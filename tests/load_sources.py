"""Sources with a load stage for the tests (importable by spawned workers)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

import aioloader


class Keys(aioloader.Reader):
    """Keys 0..n-1 (sync read); ``async load`` returns {"k", "pid", "inflight", "attempt"}.

    ``fail``: key -> how many first attempts fail, with ``error`` (a type); the attempt
    counts live in the process that loads, so a key's attempts are counted where it goes.
    """

    def __init__(self, fail: dict[int, int] | None = None,
                 error: type[Exception] = ConnectionResetError, delay: float = 0.0,
                 always_fail: frozenset[int] = frozenset()) -> None:
        self.fail = fail or {}
        self.error = error
        self.delay = delay
        self.always_fail = always_fail
        self._attempts: dict[int, int] = {}
        self._inflight = 0
        self._peak = 0

    def read(self, n: int) -> Any:
        yield from range(n)

    async def load(self, key: int) -> dict[str, Any]:
        attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
        self._inflight += 1
        self._peak = max(self._peak, self._inflight)
        try:
            await asyncio.sleep(self.delay)  # stands for I/O: let the other loads start
            if key in self.always_fail or attempt <= self.fail.get(key, 0):
                raise self.error(f"injected failure of key {key}, attempt {attempt}")
            return {"k": key, "pid": os.getpid(), "peak": self._peak, "attempt": attempt}
        finally:
            self._inflight -= 1


class AsyncKeys(Keys):
    """The same, with an async ``read`` (an async generator of keys)."""

    async def read(self, n: int) -> Any:  # type: ignore[override]
        for i in range(n):
            yield i


class AsyncItems(torch.utils.data.Dataset[Any]):
    """A map-style dataset whose ``__getitem__`` is a coroutine."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"k": i}


class Names(torch.utils.data.Dataset[str]):
    """Map-style items that are keys for a ``load_fn``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        return f"obj-{i:05d}"


async def load_name(name: str) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"k": int(name.split("-")[1])}


def load_name_blocking(name: str) -> dict[str, Any]:
    return {"k": int(name.split("-")[1]), "x": torch.ones(3) * 2}


class KeyStream(torch.utils.data.IterableDataset[int]):
    """An IterableDataset of keys that shards itself across workers, torch's way."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        k, m = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(k, self.n, m))


class Hang(aioloader.Reader):
    """Every load waits forever (until cancelled); each start and each cancel is written
    to a file, so the test sees them from the outside."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def read(self, n: int) -> Any:
        yield from range(n)

    async def load(self, key: int) -> Any:
        path = os.path.join(self.log_dir, f"{os.getpid()}-{key}")
        with open(path + ".started", "w"):
            pass
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            with open(path + ".cancelled", "w"):
                pass
            raise
