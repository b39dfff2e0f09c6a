"""``worker_nice``: every worker process, restarted and recycled ones too, runs that much
nicer than the consumer's process; the consumer's own priority is left alone."""

from __future__ import annotations

import os

import pytest

import aioloader
from tests.core_sources import Niceness


def _seen(loader: aioloader.DataLoader) -> tuple[set[int], set[int]]:
    """The niceness values and the pids of the processes that read the samples."""
    nices: set[int] = set()
    pids: set[int] = set()
    with loader:
        for batch in loader:
            nices.update(batch["nice"].tolist())
            pids.update(batch["pid"].tolist())
    return nices, pids


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_workers_run_nicer_than_the_consumer(start_method: str) -> None:
    mine = os.nice(0)
    loader = aioloader.DataLoader(Niceness(8), batch_size=2, num_workers=2, quiet=True,
                                  start_method=start_method, worker_nice=5)
    nices, pids = _seen(loader)
    assert nices == {min(mine + 5, 19)}
    assert os.getpid() not in pids and len(pids) == 2
    assert os.nice(0) == mine  # the consumer's process keeps its priority


@pytest.mark.parametrize(("cores", "nice", "expected"), [
    (4, None, 0),  # fewer workers than cores: a core is left for the consumer
    (2, None, 19),  # as many as the cores (issue 23)
    (1, None, 19),
    (2, 0, 0),  # an explicit 0 stays 0
    (2, 4, 4),
])
def test_the_default_nices_workers_that_fill_the_cores(
        monkeypatch: pytest.MonkeyPatch, cores: int, nice: int | None, expected: int) -> None:
    monkeypatch.setattr(aioloader._options, "usable_cores", lambda: cores)
    loader = aioloader.DataLoader(Niceness(8), batch_size=2, num_workers=2, quiet=True,
                                  worker_nice=nice)
    assert loader.worker_nice == expected
    nices, _ = _seen(loader)
    assert nices == {min(os.nice(0) + expected, 19)}


@pytest.mark.parametrize("kwargs", [{}, {"worker_type": "thread", "num_workers": 8}])
def test_the_default_is_0_without_worker_processes(kwargs: dict[str, object]) -> None:
    loader = aioloader.DataLoader(Niceness(4), batch_size=2, quiet=True, **kwargs)  # type: ignore[arg-type]
    assert loader.worker_nice == 0
    loader.close()


def test_the_cores_are_the_affinity_mask() -> None:
    assert aioloader._options.usable_cores() == len(os.sched_getaffinity(0))


def test_recycled_workers_are_niced_too() -> None:
    loader = aioloader.DataLoader(Niceness(12), batch_size=2, num_workers=1, quiet=True,
                                  worker_nice=3, max_batches_per_worker=2)
    nices, pids = _seen(loader)
    assert len(pids) == 3  # a new process every two batches
    assert nices == {min(os.nice(0) + 3, 19)}


async def test_async_face_and_a_second_epoch() -> None:
    loader = aioloader.DataLoader(Niceness(4), batch_size=2, num_workers=2, quiet=True,
                                  worker_nice=19)
    try:
        for _ in range(2):
            seen = {n async for batch in loader for n in batch["nice"].tolist()}
            assert seen == {19}
    finally:
        await loader.aclose()


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"worker_nice": 20, "num_workers": 1}, "from 0 to 19"),
    ({"worker_nice": -1, "num_workers": 1}, "from 0 to 19"),
    ({"worker_nice": True, "num_workers": 1}, "from 0 to 19"),
    ({"worker_nice": 2.0, "num_workers": 1}, "from 0 to 19"),
    ({"worker_nice": 3}, "num_workers=0"),
    ({"worker_nice": 3, "num_workers": 2, "worker_type": "thread"}, "worker_type='thread'"),
])
def test_bad_values_are_refused_at_construction(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match="worker_nice") as info:
        aioloader.DataLoader(Niceness(4), batch_size=2, quiet=True, **kwargs)  # type: ignore[arg-type]
    assert says in str(info.value)


def test_the_bench_leaves_the_default_to_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aioloader bench`` without ``--worker-nice`` measures the loader as users get it."""
    from aioloader.bench._measure import aio_loader
    from aioloader.bench._runner import Plan, default_batches, spec_for
    from aioloader.bench._workloads import WORKLOADS

    monkeypatch.setattr(aioloader._options, "usable_cores", lambda: 2)
    plan = Plan(num_workers=2, start_method="fork", pairs=1, batches=default_batches(True),
                face="async", loop="asyncio", timeout=60.0)
    spec = spec_for(plan, "tiny", "aioloader")
    assert spec.worker_nice is None
    loader = aio_loader(spec, WORKLOADS["tiny"], [0, 1])
    assert loader.worker_nice == 19
    loader.close()
