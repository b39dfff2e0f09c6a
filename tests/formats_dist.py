"""The rank entry point of the format readers' distributed tests (spawn pickles it): each
rank reads with 2 workers, whole, then interrupted after ``cut`` batches and resumed from
its state on a fresh loader; it writes what it saw."""

from __future__ import annotations

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
        reader = ParquetReader(os.path.join(where, "*.parquet"), columns=["i", "text"])
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


def check_reshape_refused(make: Callable[[int], aioloader.DataLoader]) -> None:
    """A state taken with 2 workers, loaded with another number: the loader's ResumeError,
    which says what to do (the readers shard themselves)."""
    import pytest

    with make(2) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with make(1) as loader, pytest.raises(aioloader.ResumeError, match="splits itself"):
        loader.load_state_dict(state)


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
