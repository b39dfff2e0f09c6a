"""Resume on another world size (issue 21), run on each torch.distributed rank (spawned).

Phase "save" runs on 2 ranks: each rank takes some batches of epoch 0 and writes its state,
as a torchrun script does at a checkpoint. Phase "resume" runs on another world size (and
another num_workers): every rank loads all the saved states, finishes epoch 0 and runs
epoch 1. The test puts the ranks' batches together. The shared folder is ``$RESHAPE_DIR``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resume_sources import Items, SyncReader

import aioloader

TAKEN = 4  # batches of epoch 0 each rank delivers before its checkpoint

SOURCES: dict[str, Callable[[int], aioloader.DataLoader]] = {
    "map": lambda workers: aioloader.DataLoader(Items(37), batch_size=3, shuffle=True, seed=2,
                                                num_workers=workers, quiet=True),
    "cached": lambda workers: aioloader.DataLoader(SyncReader(41), batch_size=3, shuffle=True,
                                                   seed=2, num_workers=workers, quiet=True),
    "lazy": lambda workers: aioloader.DataLoader(SyncReader(41), batch_size=3, shuffle=True,
                                                 seed=2, num_workers=workers,
                                                 max_instances_in_memory=6, quiet=True),
}


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["i"]]


def _dir() -> Path:
    return Path(os.environ["RESHAPE_DIR"])


def save_states(makers: dict[str, Callable[[], aioloader.DataLoader]], folder: Path,
                rank: int, taken: int = TAKEN) -> dict[str, Any]:
    """Each maker's loader takes ``taken`` batches on this rank, then writes its state to
    ``folder/NAME-rankR.json``, as a torchrun script does at a checkpoint."""
    out: dict[str, Any] = {}
    for name, make in makers.items():
        loader = make()
        try:
            batches = iter(loader)
            got = [ids(next(batches)) for _ in range(taken)]
            state = loader.state_dict()
        finally:
            loader.close()
        (folder / f"{name}-rank{rank}.json").write_text(json.dumps(state))
        out[name] = {"taken": got, "bytes": len(json.dumps(state))}
    return out


def case_save(rank: int, world: int) -> dict[str, Any]:
    return save_states({name: functools.partial(make, 2) for name, make in SOURCES.items()},
                       _dir(), rank)


def case_resume(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    workers = 0 if world == 1 else 1
    for name, make in SOURCES.items():
        states = [json.loads(p.read_text()) for p in sorted(_dir().glob(f"{name}-rank*.json"))]
        loader = make(workers)
        try:
            try:
                loader.load_state_dict(states)
            except aioloader.ResumeError as exc:
                out[name] = {"refused": str(exc)}
                continue
            rest = [ids(b) for b in loader]
            again = loader.state_dict()  # taken inside the resumed pass: resumes it again
            next_epoch = [ids(b) for b in loader]
        finally:
            loader.close()
        fresh = make(workers)
        try:
            whole = [ids(b) for b in fresh]
            fresh.set_epoch(1)
            whole_next = [ids(b) for b in fresh]
        finally:
            fresh.close()
        out[name] = {"rest": rest, "next": next_epoch, "whole": whole,
                     "whole_next": whole_next, "again_pass": again["pass"]}
    return out


def case_resume_inside(rank: int, world: int) -> dict[str, Any]:
    """States taken inside a resumed pass (2 ranks -> this world size), resumed once more
    on the same shape: the batches go on exactly (the state carries the pass's history)."""
    out: dict[str, Any] = {}
    for name in ("map", "cached"):
        states = [json.loads(p.read_text()) for p in sorted(_dir().glob(f"{name}-rank*.json"))]
        loader = SOURCES[name](1)
        try:
            loader.load_state_dict(states)
            batches = iter(loader)
            first = [ids(next(batches)) for _ in range(2)]
            inside = json.loads(json.dumps(loader.state_dict()))
            rest = [ids(b) for b in batches]
        finally:
            loader.close()
        again = SOURCES[name](1)  # (a cached reader's ranks cache their workers' shards)
        try:
            again.load_state_dict(inside)
            resumed = [ids(b) for b in again]
        finally:
            again.close()
        out[name] = {"first": first, "rest": rest, "resumed": resumed}
    return out


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "save": case_save,
    "resume": case_resume,
    "resume_inside": case_resume_inside,
}
