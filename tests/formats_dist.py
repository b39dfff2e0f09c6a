"""The rank entry points of the format readers' distributed tests (spawn pickles them):
each rank reads with 2 workers, whole, then interrupted after ``cut`` batches and resumed
from its state on a fresh loader; or it stops mid-epoch and saves its state, and other
ranks (another world size, other numbers of workers) resume from every rank's states. Each
writes what it saw."""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dist_helpers
import torch.distributed as dist

import aioloader
from aioloader.readers import ParquetReader, WebDatasetReader


def make(kind: str, where: str, workers: int) -> aioloader.DataLoader:
    if kind == "webdataset":
        reader: Any = WebDatasetReader(os.path.join(where, "shard-{000..005}.tar"),
                                       decode=True, shuffle_shards=True, seed=5)
    else:
        reader = ParquetReader(os.path.join(where, "*.parquet"), columns=["i", "text"],
                               shuffle_row_groups=True, seed=5)
    return aioloader.DataLoader(reader, batch_size=3, shuffle=True, seed=1, num_workers=workers,
                                max_instances_in_memory=6, even_batches=False, quiet=True)


def ids(batch: Any, kind: str) -> list[int]:
    return [int(i) for i in (batch["cls"] if kind == "webdataset" else batch["i"]).tolist()]


def interrupted(make: Callable[[], aioloader.DataLoader], cut: int,
                ids: Callable[[Any], list[int]]) -> tuple[list[Any], list[Any], list[Any]]:
    """(an epoch's batches, the first ``cut`` of another run, the rest after its state went
    through JSON into a fresh loader); resuming must read nothing to skip (no
    ResumeWarning)."""
    with make() as loader:
        whole = [ids(b) for b in loader]
    with make() as loader:
        batches = iter(loader)
        before = [ids(next(batches)) for _ in range(cut)]
        state = json.loads(json.dumps(loader.state_dict()))
    with make() as loader, warnings.catch_warnings():
        warnings.simplefilter("error", aioloader.ResumeWarning)
        loader.load_state_dict(state)
        after = [ids(b) for b in loader]
    return whole, before, after


def check_resumed(whole: list[Any], before: list[Any], after: list[Any], *,
                  ordered: bool) -> None:
    """The resumed run's batches are the whole run's; ``ordered``: in the same order (one
    process; several workers' batches arrive in any order, each worker's exact)."""
    if ordered:
        assert before + after == whole
    else:
        assert sorted(map(tuple, before + after)) == sorted(map(tuple, whole))


def check_workers_reshaped(make: Callable[[int], aioloader.DataLoader], n: int,
                           ids: Callable[[Any], list[int]], *, taken: int = 3,
                           start: int = 2, to: tuple[int, ...] = (3, 0)) -> None:
    """A state taken with ``start`` workers mid-epoch resumes with each of ``to`` workers:
    every item of the epoch once; the next epoch whole."""
    before, state = stop(lambda: make(start), taken, ids)
    for workers in to:
        check_once(before + resume(functools.partial(make, workers), [state], 2, ids), n)
        with make(workers) as loader:
            loader.load_state_dict(state)
            list(loader)
            check_once([ids(b) for b in loader], n)


def stop(make: Callable[[], aioloader.DataLoader], cut: int,
         ids: Callable[[Any], list[int]]) -> tuple[list[list[int]], Any]:
    """The first ``cut`` batches of an epoch, and the state after them (through JSON)."""
    with make() as loader:
        batches = iter(loader)
        before = [ids(next(batches)) for _ in range(cut)]
        return before, json.loads(json.dumps(loader.state_dict()))


def resume(make: Callable[[], aioloader.DataLoader], states: list[Any], cut: int,
           ids: Callable[[Any], list[int]]) -> list[list[int]]:
    """The rest of the epoch from ``states`` (every rank's, taken on another shape),
    stopped after ``cut`` batches and resumed again on this shape from its own state; then
    the next epoch, which must be whole again (checked by the caller)."""
    with make() as loader:
        loader.load_state_dict(states)
        batches = iter(loader)
        first = [ids(b) for _, b in zip(range(cut), batches, strict=False)]
        again = json.loads(json.dumps(loader.state_dict()))
    with make() as loader:
        loader.load_state_dict(again)
        rest = [ids(b) for b in loader]
    return first + rest


def check_once(seen: list[list[int]], n: int) -> None:
    flat = sorted(i for batch in seen for i in batch)
    assert flat == list(range(n)), (
        f"{len(flat)} items, missing {sorted(set(range(n)) - set(flat))}, twice "
        f"{sorted({i for i in flat if flat.count(i) > 1})}")


def save_main(rank: int, world: int, port: int, kind: str, where: str, out_dir: str,
              cut: int, workers: int) -> None:
    """A rank that stops mid-epoch after ``cut`` batches: its batches and state to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        before, state = stop(lambda: make(kind, where, workers), cut, lambda b: ids(b, kind))
        with open(os.path.join(out_dir, f"{kind}-saved{rank}.json"), "w") as f:
            json.dump({"before": before, "state": state}, f)
    finally:
        dist.destroy_process_group()


def resume_main(rank: int, world: int, port: int, kind: str, where: str, out_dir: str,
                cut: int, workers: int) -> None:
    """A rank of another shape that resumes from every saved rank's state (see
    :func:`resume`); its batches to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        states = saved_states(Path(out_dir), kind)
        after = resume(lambda: make(kind, where, workers), states, cut, lambda b: ids(b, kind))
        with open(os.path.join(out_dir, f"{kind}-resumed{rank}.json"), "w") as f:
            json.dump(after, f)
    finally:
        dist.destroy_process_group()


def saved_states(out: Path, kind: str) -> list[Any]:
    return [json.loads(p.read_text())["state"] for p in sorted(out.glob(f"{kind}-saved*.json"))]


def check_reshaped(kind: str, where: Path, out: Path, n: int) -> None:
    """2 ranks x 2 workers stop mid-epoch (:func:`save_main`); from their states, the rest
    of the epoch on 1 rank x 3 workers (here) and on 4 ranks x 1 worker: with what the 2 x 2
    ranks delivered, every item once; and the next epoch on the new shape is whole."""
    dist_helpers.run_ranks(save_main, 2, kind, str(where), str(out), 4, 2)
    before = [b for p in sorted(out.glob(f"{kind}-saved*.json"))
              for b in json.loads(p.read_text())["before"]]
    states = saved_states(out, kind)
    check_once(before + resume(lambda: make(kind, str(where), 3), states, 2,
                               lambda b: ids(b, kind)), n)
    dist_helpers.run_ranks(resume_main, 4, kind, str(where), str(out), 1, 1)
    after = [b for r in range(4)
             for b in json.loads((out / f"{kind}-resumed{r}.json").read_text())]
    check_once(before + after, n)


def rank_main(rank: int, world: int, port: int, kind: str, where: str, out_dir: str,
              cut: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        whole, before, after = interrupted(lambda: make(kind, where, 2), cut,
                                           lambda b: ids(b, kind))
        with open(os.path.join(out_dir, f"{kind}-rank{rank}.json"), "w") as f:
            json.dump({"whole": whole, "before": before, "after": after}, f)
    finally:
        dist.destroy_process_group()


def run(kind: str, where: Path, out: Path) -> dict[int, dict[str, Any]]:
    """2 ranks x 2 workers (:func:`rank_main`, interrupted after 3 batches): what each rank
    saw."""
    dist_helpers.run_ranks(rank_main, 2, kind, str(where), str(out), 3)
    return {r: json.loads((out / f"{kind}-rank{r}.json").read_text()) for r in range(2)}
