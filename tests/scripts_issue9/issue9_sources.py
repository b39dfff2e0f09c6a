"""Module-level datasets, readers and collates for test_issue9 and test_user_patterns.

They live at module level in a module of their own so that ``start_method="spawn"`` and
spawned torch.distributed ranks can pickle them by reference (the test modules put this
folder on ``sys.path``, which spawned children inherit).
"""

from __future__ import annotations

import os
import select
import time
from collections import UserDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

import aioloader

SURROGATE_NAME = "caf\udce9.jpg"  # os.fsdecode(b"caf\xe9.jpg") on a UTF-8 system


class Ints(Dataset[torch.Tensor]):
    """``n`` samples, sample ``i`` is ``tensor(i)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Records(Dataset[dict[str, Any]]):
    """``{"index": i, "x": [i, 2i], "pid": <the pid that built it>}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "x": torch.tensor([i, 2 * i]), "pid": os.getpid()}


class Slow(Dataset[dict[str, Any]]):
    """As :class:`Records`, ``delay`` seconds per sample (a dataset that makes the consumer
    really wait)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return {"index": i, "pid": os.getpid()}


class Gate:
    """A one-shot gate that forked workers (and threads) wait on: a pipe, opened by writing
    a byte that nobody reads, so that every waiter, now or later, sees it readable.

    Not ``multiprocessing.Event``: its ``set()`` waits for every sleeper to wake, and a
    worker killed while it sleeps there never does (``set()`` then hangs).
    """

    def __init__(self) -> None:
        self.r, self.w = os.pipe()

    def wait(self, timeout: float) -> bool:
        return bool(select.select([self.r], [], [], timeout)[0])

    def set(self) -> None:
        os.write(self.w, b"x")

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class Gated(Dataset[dict[str, Any]]):
    """Samples below ``open_below`` come at once; the others wait for ``gate`` (a
    :class:`Gate`, inherited by forked workers) for at most ``limit`` seconds.

    The consumer therefore waits for batch ``open_below`` until the test opens the gate.
    """

    def __init__(self, n: int, gate: Gate, open_below: int = 1, limit: float = 120.0) -> None:
        self.n, self.gate, self.open_below, self.limit = n, gate, open_below, limit

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i >= self.open_below:
            self.gate.wait(self.limit)
        return {"index": i}


class Huge(Dataset[torch.Tensor]):
    """Samples of ``numel`` float32 (16 Mi elements: a 64 MB tensor), filled with ``i``."""

    def __init__(self, n: int, numel: int = 16 << 20) -> None:
        self.n, self.numel = n, numel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.numel,), float(i), dtype=torch.float32)


class Images(Dataset[dict[str, Any]]):
    """A new image tensor per sample (as a decoding dataset allocates one), label ``i``."""

    def __init__(self, n: int, size: int = 32) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        image = torch.empty((3, self.size, self.size), dtype=torch.uint8)
        image.fill_(i % 251)
        return {"image": image, "label": i}


class Named(Dataset[dict[str, Any]]):
    """A file name holding an undecodable byte (surrogate escape) next to a tensor."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"path": f"{i}-{SURROGATE_NAME}", "x": torch.tensor([i, i, i])}


class TwoMillion(Dataset[int]):
    """2,000,000 indices, nothing else: planning a shuffled epoch is the whole cost."""

    def __len__(self) -> int:
        return 2_000_000

    def __getitem__(self, i: int) -> int:
        return i


class Trickle(aioloader.Reader):
    """Yields ``{"index": i}`` every ``delay`` seconds: slow, but never silent."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def read(self, data_path: Any) -> Any:
        for i in range(self.n):
            time.sleep(self.delay)
            yield {"index": i}


class SplitByNodeAndWorker(IterableDataset[dict[str, int]]):
    """Splits itself by rank and by worker, as ``datasets.split_dataset_by_node`` and
    webdataset's ``split_by_node`` + ``split_by_worker`` do: the loader must not split it
    again."""

    def __init__(self, n: int) -> None:
        self.n = n

    def indices(self) -> range:
        """This rank's and this worker's share of ``range(n)``, one in every ``shards``."""
        import torch.distributed as dist

        rank, world = ((dist.get_rank(), dist.get_world_size())
                       if dist.is_available() and dist.is_initialized() else (0, 1))
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        shard, shards = rank * nw + wid, world * nw
        return range(shard, self.n, shards)

    def __iter__(self) -> Any:
        return iter({"index": i} for i in self.indices())


# --------------------------------------------------------------------------- odd batch types

class Encoding(UserDict):  # type: ignore[type-arg]
    """A UserDict subclass, as transformers' BatchEncoding is."""

    def to_device_names(self) -> list[str]:
        return [str(v.device) for v in self.data.values() if isinstance(v, torch.Tensor)]


@dataclass
class Batch:
    ids: torch.Tensor
    lengths: torch.Tensor
    names: list[str]
    weight: torch.Tensor  # 0-d


def collate_encoding(samples: list[dict[str, Any]]) -> Encoding:
    return Encoding({"input_ids": torch.stack([s["x"] for s in samples]),
                     "attention_mask": torch.ones(len(samples), 3, dtype=torch.bool),
                     "paths": [s["path"] for s in samples]})


def collate_dataclass(samples: list[dict[str, Any]]) -> Batch:
    return Batch(ids=torch.stack([s["x"] for s in samples]),
                 lengths=torch.tensor([len(s["x"]) for s in samples]),
                 names=[s["path"] for s in samples],
                 weight=torch.tensor(0.5))


def collate_scalars(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """0-d tensors of several dtypes next to the batch."""
    return {"x": torch.stack([s["x"] for s in samples]), "count": torch.tensor(len(samples)),
            "mean": torch.stack([s["x"] for s in samples]).float().mean(),
            "flag": torch.tensor(True), "half": torch.tensor(1.5, dtype=torch.float16)}
