"""The first-batch workload: a fresh loader of tiny samples, timed to its first batch.

``measure`` runs it in a process of its own (the bench forks one per run), so each loader
starts its workers from nothing: with spawn, an interpreter per worker that imports torch
and unpickles the dataset; with forkserver, the server too.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from ._measure import Result, Spec, aio_loader, measure_here, peer_setup, per_side
from ._peers import open_loader
from ._workloads import FIRST_BATCHES, Workload, first_workload


def first_batch(spec: Spec) -> Result:
    """Milliseconds from ``DataLoader(...)`` to the loader built, to its first batch (the
    first ``iter()`` / ``__aiter__`` included), and to the loader closed again."""
    workload = first_workload()
    dataset = workload.dataset(FIRST_BATCHES * workload.batch_size)
    gc.collect()
    start, built, first, closed = per_side(spec, workload, dataset, peer=_peer_first,
                                           sync=_aio_sync_first, aio=_aio_async_first)
    return {"construct_ms": (built - start) * 1e3, "ttfb_ms": (first - start) * 1e3,
            "close_ms": (closed - first) * 1e3}


def _peer_first(spec: Spec, workload: Workload, dataset: Any) -> list[float]:
    stamps = [time.perf_counter()]
    with open_loader(spec.side, dataset, peer_setup(spec, workload)) as loader:
        stamps.append(time.perf_counter())
        it = iter(loader)
        next(it)
        stamps.append(time.perf_counter())
        del it, loader  # torch's persistent workers stop with the loader's last reference
    stamps.append(time.perf_counter())
    return stamps


def _aio_sync_first(spec: Spec, workload: Workload, dataset: Any) -> list[float]:
    stamps = [time.perf_counter()]
    with aio_loader(spec, workload, dataset) as loader:
        stamps.append(time.perf_counter())
        for _ in loader:
            stamps.append(time.perf_counter())
            break
    stamps.append(time.perf_counter())
    return stamps


async def _aio_async_first(spec: Spec, workload: Workload, dataset: Any) -> list[float]:
    stamps = [time.perf_counter()]
    async with aio_loader(spec, workload, dataset) as loader:
        stamps.append(time.perf_counter())
        async for _ in loader:
            stamps.append(time.perf_counter())
            break
    stamps.append(time.perf_counter())
    return stamps


def measure(spec: Spec) -> Result:
    """Run ``spec`` here, whatever its kind, and return its figures."""
    return first_batch(spec) if spec.kind == "first" else measure_here(spec)
