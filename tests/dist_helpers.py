"""Module-level sources and the rank entry point for test_distributed (spawn pickles them)."""

from __future__ import annotations

import functools
import json
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

import aioloader


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: Callable[..., None], world: int, *args: Any,
              timeout: float = 240) -> None:
    """``target(rank, world, port, *args)`` in ``world`` spawned processes (gloo ranks);
    an AssertionError when one fails, none left running."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * world, "a rank failed"


class Numbers(aioloader.Reader):
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: object):  # type: ignore[no-untyped-def]
        for i in range(self.n):
            yield {"index": i}


class NumbersDataset(Dataset[dict[str, int]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": i}


class TorchSharded(IterableDataset[dict[str, int]]):
    """Shards itself across ranks and workers, as datasets.split_dataset_by_node does: the
    loader never splits an IterableDataset (torch's rule)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        rank, world = dist.get_rank(), dist.get_world_size()
        return iter({"index": i} for i in range(rank * nw + wid, self.n, world * nw))


def rank_main(rank: int, world: int, port: int, out_dir: str, n: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        cases = {
            "reader_cached": (Numbers(n), {}),
            "reader_lazy": (Numbers(n), {"max_instances_in_memory": 8}),
            "map_style": (NumbersDataset(n), {}),
            "map_style_shuffled": (NumbersDataset(n), {"shuffle": True, "seed": 3}),
            "iterable": (TorchSharded(n), {"max_instances_in_memory": 8}),
        }
        for name, (source, extra) in cases.items():
            loader = aioloader.DataLoader(source, batch_size=3, num_workers=2, quiet=True,
                                          **extra)
            try:
                batches = list(loader)
            finally:
                loader.close()
            results[name] = {"indices": [i for b in batches for i in b["index"].tolist()],
                             "batches": len(batches)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def datapipe_main(rank: int, world: int, port: int, out_dir: str, n: int) -> None:
    """Torch's loader and ours on a datapipe with a ``sharding_filter``, on this rank, with
    0, 1 and 2 workers: what each yields, in order (ours with and without even_batches)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.datapipes.iter import IterableWrapper

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results: dict[str, dict[str, list[int]]] = {}
        for workers in (0, 1, 2):
            results[str(workers)] = {}
            makers = {"torch": DataLoader,
                      "ours": functools.partial(aioloader.DataLoader, even_batches=False),
                      "ours_even": aioloader.DataLoader}
            for name, make in makers.items():
                loader = make(IterableWrapper(list(range(n))).sharding_filter(),
                              batch_size=None, num_workers=workers)
                try:
                    results[str(workers)][name] = [int(i) for i in loader]
                finally:
                    getattr(loader, "close", lambda: None)()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
