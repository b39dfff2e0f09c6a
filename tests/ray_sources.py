"""Sources for tests/test_ray.py. They travel to Ray actors by value (cloudpickle), so the
actors need not import the tests directory."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

import aioloader


def item(i: int) -> dict[str, Any]:
    info = aioloader.get_worker_info()
    return {"i": i, "r": torch.rand(()), "x": torch.full((3,), i),
            "w": info.id if info is not None else -1}


def _once(flag: str | None) -> bool:
    """True the first time across every process (an exclusive create): a replacement
    worker that reads the same index again must not die again."""
    if flag is None:
        return False
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Items(Dataset[dict[str, Any]]):
    """A map-style dataset; at index ``kill_at`` its worker SIGKILLs itself, once;
    at ``fail_at`` it raises KeyError."""

    def __init__(self, n: int, kill_at: int | None = None, flag: str | None = None,
                 fail_at: int | None = None, sleep: float = 0.0) -> None:
        self.n, self.kill_at, self.flag, self.fail_at = n, kill_at, flag, fail_at
        self.sleep = sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.sleep:
            time.sleep(self.sleep)  # a slow sample (a decode, a download)
        if i == self.fail_at:
            raise KeyError(f"no item {i}")
        if i == self.kill_at and _once(self.flag):
            os.kill(os.getpid(), signal.SIGKILL)
        return item(i)


class Lines(aioloader.Reader):
    """A streaming reader (the loader shards it); at instance ``kill_at`` its worker
    SIGKILLs itself, once."""

    def __init__(self, n: int, kill_at: int | None = None, flag: str | None = None) -> None:
        self.n, self.kill_at, self.flag = n, kill_at, flag

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            if i == self.kill_at and _once(self.flag):
                os.kill(os.getpid(), signal.SIGKILL)
            yield item(i)



class Features(collections.UserDict[str, Any]):
    """A UserDict subclass, as transformers' BatchEncoding is."""


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    name: str


def mixed_collate(items: list[dict[str, Any]]) -> Any:
    """Every kind of value a batch may hold: it must come back as it was built."""
    i = torch.tensor([x["i"] for x in items])
    return {
        "bf16": i.to(torch.bfloat16) / 3, "bool": i % 2 == 0, "c64": i.to(torch.complex64),
        "zero_d": i.sum(), "empty": torch.empty(0, 3), "t": torch.arange(12.0).view(3, 4).t(),
        "grad": i.float().requires_grad_(), "features": Features(ids=i, text="a b"),
        "pair": Pair(i * 2, "p"), "tuple": (i, [1.5, "x"]), "none": None,
    }


class Keys(aioloader.Reader):
    """Keys, loaded concurrently by the load stage (an async ``load``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: Any) -> Iterator[int]:
        yield from range(self.n)

    async def load(self, key: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return item(key)


def wait_for_a_writer(path: str, worker_id: int) -> None:
    """A worker_init_fn that holds its worker's start until someone opens the FIFO
    ``path`` for writing and closes it (a slow start: a big import, a cold cache)."""
    with open(path) as fifo:
        fifo.read()
