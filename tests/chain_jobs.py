"""One shape of a chain of job shapes, run on each rank of a :mod:`rank_servers` job.

``step`` builds a loader of the named source kind, loads every rank's states from the
previous shape (if any), takes up to ``stop`` batches of the pass, and says what it saw,
its state after the last batch taken (still in the pass) and its padding.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from resume_sources import Items, SyncReader, item
from torch.utils.data import IterableDataset, get_worker_info

import aioloader


class Keys(aioloader.Reader):
    """Keys 0..n-1 for a load stage; a key's load takes a few turns of the loop, so with
    ordered=False later keys finish first."""

    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: Any) -> Any:
        yield from range(self.n)

    async def load(self, key: int) -> dict[str, Any]:
        for _ in range((key * 7919) % 7):
            await asyncio.sleep(0)
        return item(key)


class SplitsItself(IterableDataset[dict[str, Any]]):
    """Splits itself across ranks and workers, one by one (split_dataset_by_node's way)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        import torch.distributed as dist

        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        rank, world = ((dist.get_rank(), dist.get_world_size())
                       if dist.is_available() and dist.is_initialized() else (0, 1))
        return iter(item(i) for i in range(rank * nw + wid, self.n, world * nw))


def make(kind: str, n: int, workers: int, opts: dict[str, Any]) -> aioloader.DataLoader:
    """A loader of source ``kind`` over ``n`` instances; ``opts``: the loader's arguments
    (batch_size, shuffle, seed, drop_last, even_batches, max_instances_in_memory)."""
    common = dict(opts, num_workers=workers, quiet=True)
    if kind == "map":
        common.pop("max_instances_in_memory", None)
        return aioloader.DataLoader(Items(n), **common)
    if kind == "cached":
        common.pop("max_instances_in_memory", None)
        return aioloader.DataLoader(SyncReader(n), **common)
    if kind == "lazy":
        return aioloader.DataLoader(SyncReader(n), **common)
    if kind == "iterable":
        return aioloader.DataLoader(SplitsItself(n), **common)
    assert kind == "unordered", kind
    keys = Keys(n)
    return aioloader.DataLoader(keys, load_fn=keys.load, concurrency=4, ordered=False,
                                **common)


def step(rank: int, world: int, kind: str, n: int, workers: int, opts: dict[str, Any],
         states: list[Any] | None, stop: int | None) -> dict[str, Any]:
    """Take up to ``stop`` batches (None: all) of the pass, resumed from ``states``; the
    state is taken after each batch, so a rank whose pass ends first still gives one of
    the pass (an epoch's end would take the next pass's)."""
    loader = make(kind, n, workers, opts)
    seen: list[list[int]] = []
    try:
        if states:
            loader.load_state_dict(states)
        state = loader.state_dict()
        batches = iter(loader)
        done = False
        while stop is None or len(seen) < stop:
            try:
                batch = next(batches)
            except StopIteration:
                done = True
                break
            seen.append([int(i) for i in batch["i"]])
            state = loader.state_dict()
        stats = loader.stats()
    finally:
        loader.close()
    return {"batches": seen, "state": json.loads(json.dumps(state)), "done": done,
            "padded": stats.padded, "state_bytes": len(json.dumps(state))}
