"""The rank entry point of the torch.distributed user patterns (spawned: module level).

Each rank runs the named cases the way a training script would (loaders never closed) and
writes ``rank<r>.json``: per case the indices it saw, or the error it hit. A case that
fails on one rank is recorded, not raised, so that the other cases still report.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_helpers import NumbersDataset as Numbers  # tests/ is on sys.path too
from issue9_sources import SplitByNodeAndWorker
from torch.utils.data import BatchSampler, DistributedSampler

import aioloader

N = 240
# Loaders of the sharding cases stay referenced (never closed) until the rank ends, so that
# those cases test sharding alone; "three_loaders" is the case that drops its loaders.
KEEP: list[aioloader.DataLoader] = []


def _indices(loader: aioloader.DataLoader) -> list[int]:
    return [i for batch in loader for i in batch["index"].tolist()]


def _kept(loader: aioloader.DataLoader) -> aioloader.DataLoader:
    KEEP.append(loader)
    return loader


def case_batch_sampler(rank: int, world: int) -> dict[str, Any]:
    """batch_sampler=BatchSampler(DistributedSampler(ds), 8, False), as DDP scripts write it."""
    ds = Numbers(N)
    sampler = DistributedSampler(ds, shuffle=False)
    loader = _kept(aioloader.DataLoader(ds, batch_sampler=BatchSampler(sampler, 8, False),
                                        num_workers=2, quiet=True))
    return {"indices": _indices(loader), "expected": [int(i) for i in sampler]}


def _iterable(max_instances_in_memory: int | None) -> dict[str, Any]:
    loader = _kept(aioloader.DataLoader(SplitByNodeAndWorker(N), batch_size=8, num_workers=2,
                                        max_instances_in_memory=max_instances_in_memory,
                                        quiet=True))
    return {"indices": _indices(loader)}


def case_iterable_lazy(rank: int, world: int) -> dict[str, Any]:
    return _iterable(16)


def case_iterable_cached(rank: int, world: int) -> dict[str, Any]:
    return _iterable(None)


def case_three_loaders(rank: int, world: int) -> dict[str, Any]:
    """Three loaders built in a row, each consumed and dropped, none closed."""
    out: list[list[int]] = []
    for _ in range(3):
        loader = aioloader.DataLoader(Numbers(48), batch_size=4, num_workers=2, quiet=True)
        out.append(_indices(loader))
    return {"loaders": out}


def case_sampler_set_epoch(rank: int, world: int) -> dict[str, Any]:
    """sampler.set_epoch(e) before each epoch (DistributedSampler's shuffle), never closed."""
    ds = Numbers(N)
    sampler = DistributedSampler(ds, shuffle=True, seed=5)
    loader = _kept(aioloader.DataLoader(ds, batch_sampler=BatchSampler(sampler, 8, False),
                                        num_workers=2, quiet=True))
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected = [int(i) for i in sampler]  # before the epoch: what the user asked for
        epochs.append({"indices": _indices(loader), "expected": expected})
    return {"epochs": epochs, "len": len(loader)}


def case_len_rank0_only(rank: int, world: int) -> dict[str, Any]:
    """len() called on rank 0 only (logging the number of steps): must not wait for rank 1.

    Runs last: a collective that rank 1 never joins would hang this rank.
    """
    ds = Numbers(N)
    loader = aioloader.DataLoader(
        ds, batch_sampler=BatchSampler(DistributedSampler(ds, shuffle=False), 8, False),
        num_workers=2, quiet=True)
    if rank != 0:
        return {}
    box: dict[str, Any] = {}

    def measure() -> None:
        try:
            box["len"] = len(loader)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = repr(exc)

    thread = threading.Thread(target=measure, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        return {"hang": True}
    return box


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "batch_sampler": case_batch_sampler,
    "iterable_lazy": case_iterable_lazy,
    "iterable_cached": case_iterable_cached,
    "three_loaders": case_three_loaders,
    "sampler_set_epoch": case_sampler_set_epoch,
    "len_rank0_only": case_len_rank0_only,
}


def rank_main(rank: int, world: int, port: int, out_dir: str, cases: list[str],
              registry: str = __name__) -> None:
    """Run ``cases`` from the ``CASES`` of module ``registry`` on this rank."""
    import importlib

    table = importlib.import_module(registry).CASES
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    hung = False
    try:
        for name in cases:
            try:
                results[name] = table[name](rank, world)
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                results[name] = {"error": f"{exc!r}\n{traceback.format_exc()[-3000:]}"}
            hung = hung or bool(results[name].get("hang"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        if not hung:  # a collective left waiting would hang the teardown too
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(out: Path, cases: list[str], deadline: float, world: int = 2,
              registry: str = __name__) -> dict[int, Any]:
    """Run ``cases`` (from module ``registry``'s ``CASES``) on ``world`` spawned gloo ranks;
    each rank's results, by rank.

    A rank still alive after ``deadline`` seconds is killed; a rank that wrote nothing
    fails the caller with the exit codes.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(out), cases, registry))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(deadline)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = {}
    for r in range(world):
        path = out / f"rank{r}.json"
        codes = [p.exitcode for p in procs]
        assert path.exists(), f"rank {r} wrote no results (exit codes {codes})"
        results[r] = json.loads(path.read_text())
    return results
