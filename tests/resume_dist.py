"""Resume cases run on each torch.distributed rank (spawned: module level; issue 10).

Each rank runs the same training-script pattern: one uninterrupted run, then runs that are
preempted at the same global steps on every rank and resumed from each rank's own state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from resume_sources import Items, SyncReader
from test_resume import run

import aioloader

CUTS = [{3, 9}, {5, 10}]


def _compare(make: Callable[[], aioloader.DataLoader], epochs: int = 2) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aioloader.ResumeWarning)
        whole = run(make, "sync", epochs=epochs)
        return {"whole": whole, "resumed": [run(make, "sync", cuts, epochs=epochs)
                                             for cuts in CUTS]}


def case_map_style(rank: int, world: int) -> dict[str, Any]:
    return _compare(lambda: aioloader.DataLoader(Items(37), batch_size=3, shuffle=True,
                                                 num_workers=2, quiet=True))


def case_reader_lazy(rank: int, world: int) -> dict[str, Any]:
    return _compare(lambda: aioloader.DataLoader(SyncReader(41), batch_size=3, shuffle=True,
                                                 num_workers=2, max_instances_in_memory=6,
                                                 quiet=True))


def case_reader_cached(rank: int, world: int) -> dict[str, Any]:
    return _compare(lambda: aioloader.DataLoader(SyncReader(41), batch_size=3, shuffle=True,
                                                 num_workers=2, quiet=True))


def case_stream_batches_per_epoch(rank: int, world: int) -> dict[str, Any]:
    return _compare(lambda: aioloader.DataLoader(SyncReader(41), batch_size=3, shuffle=True,
                                                 num_workers=1, max_instances_in_memory=6,
                                                 batches_per_epoch=4, quiet=True), epochs=4)


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "map_style": case_map_style,
    "reader_lazy": case_reader_lazy,
    "reader_cached": case_reader_cached,
    "stream_batches_per_epoch": case_stream_batches_per_epoch,
}
