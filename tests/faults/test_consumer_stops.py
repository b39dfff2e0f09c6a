"""Cases 4 and 8: the consumer stops early (break, raise, cancel), a soak of many stopped
epochs, and a slow consumer that must hold the workers back."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
from typing import Any

import pytest
import victims
from fault_helpers import survivors, workers

import aioloader
from aioloader.testing import CountingReader, LeakSnapshot, SlowReader, check_leaks


class Stop(Exception):
    """The consumer's own error."""


def _loader(num_workers: int, lazy: int | None, n: int = 40, method: str = "fork",
            delay: float = 0.0) -> aioloader.DataLoader:
    return aioloader.DataLoader(SlowReader(n, delay=delay), batch_size=2,
                                num_workers=num_workers, max_instances_in_memory=lazy,
                                start_method=method, quiet=True)


def _indices(batches: list[Any]) -> list[int]:
    return sorted(i for b in batches for i in b["index"].tolist())


async def _stop_async(loader: aioloader.DataLoader, how: str, at: int) -> list[int]:
    """Consume ``at`` batches, then stop the way ``how`` says; returns the worker pids."""
    seen: list[int] = []
    pids: list[int] = []

    async def consume() -> None:
        async for _ in loader:
            seen.append(1)
            if len(seen) == 1:
                pids.extend(workers())
            if len(seen) == at:
                if how == "break":
                    break
                if how == "raise":
                    raise Stop
                if how == "cancel-between":
                    started.set_result(None)
                    await asyncio.Event().wait()  # parked between two batches

    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(consume())
    if how == "cancel-between":
        await started
        task.cancel()
    elif how == "cancel-waiting":
        while len(seen) < at:  # the consumer awaits its next batch from a slow reader
            await asyncio.sleep(0.01)
        task.cancel()
    try:
        await task
    except (Stop, asyncio.CancelledError):
        pass
    return pids


def _stop_sync(loader: aioloader.DataLoader, how: str, at: int) -> list[int]:
    pids: list[int] = []
    try:
        for k, _ in enumerate(loader, 1):
            if k == 1:
                pids.extend(workers())
            if k == at:
                if how == "break":
                    break
                raise Stop
    except Stop:
        pass
    return pids


ROUNDS = 6
ASYNC_STOPS = ["break", "raise", "cancel-between", "cancel-waiting"]


@pytest.mark.parametrize(("consumer", "how", "workers_", "lazy"), [
    *[("async", h, w, 8) for h in ASYNC_STOPS for w in (1, 2)],
    # cached: batches come from memory at once, so "waiting" cannot be caught in the act
    *[("async", h, 2, None) for h in ASYNC_STOPS if h != "cancel-waiting"],
    *[("sync", h, w, lazy) for h in ("break", "raise") for w, lazy in ((1, None), (2, 8))],
])
def test_consumer_stops_then_loader_reusable(consumer: str, how: str, workers_: int,
                                             lazy: int | None) -> None:
    loader = _loader(workers_, lazy, delay=0.002 if how == "cancel-waiting" else 0.0)
    # Several rounds: whether the epoch's cleanup runs before asyncio.run shuts its loop
    # down is a race; one round could pass by luck.
    for _ in range(ROUNDS):
        t0 = time.monotonic()
        if consumer == "async":
            pids = asyncio.run(asyncio.wait_for(_stop_async(loader, how, at=3), 30))
        else:
            pids = _stop_sync(loader, how, at=3)
        stopped = time.monotonic() - t0
        assert len(pids) >= workers_
        # The stop returns only after the epoch's workers are reaped (no zombies, orphans).
        left = survivors(0.0, pids=pids)
        assert not left, f"workers alive right after the consumer stopped: {left}"
    print(f"\nLATENCY consumer-stop {consumer} {how} w{workers_}: {stopped:.2f}s for start, "
          "3 batches and the stop")
    # Usable again: a whole epoch, every instance once, from either face.
    assert _indices(list(loader)) == list(range(40))
    assert _indices(asyncio.run(_all(loader))) == list(range(40))


def test_async_stop_cached_then_loop_shutdown() -> None:
    loader = _loader(2, None)
    try:
        for k in range(20):  # cleanup raced the loop shutdown once: many rounds
            # (not "cancel-waiting": cached batches come at once, the epoch would end first
            # and its workers rightly stay for the next one)
            stops = [h for h in ASYNC_STOPS if h != "cancel-waiting"]
            pids = asyncio.run(asyncio.wait_for(
                _stop_async(loader, stops[k % len(stops)], at=3), 30))
            left = survivors(0.0, pids=pids)
            assert not left, f"round {k}: workers alive after asyncio.run returned: {left}"
    finally:
        loader.close()


async def _all(loader: aioloader.DataLoader) -> list[Any]:
    return [b async for b in loader]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.deadline(150)
def test_soak_stopped_epochs() -> None:
    """Many epochs, each stopped at a random (seeded) batch, in rotating ways."""
    # 0.1-0.5 s per epoch on 2 cores (two forks, two reaps); FAULTS_SOAK_EPOCHS for more
    # (300 ran past the deadline on a loaded box).
    epochs = int(os.environ.get("FAULTS_SOAK_EPOCHS", "150"))
    rng = random.Random(1234)
    loader = aioloader.DataLoader(victims.Indexed(64, width=256), batch_size=4, num_workers=2,
                                  quiet=True)
    lazy = aioloader.DataLoader(SlowReader(64), batch_size=4, num_workers=2,
                                max_instances_in_memory=8, quiet=True)
    for ld in (loader, lazy):  # warm: caches, first forks, allocator pools
        list(ld)
    gc.collect()
    baseline = LeakSnapshot.take()
    rss0 = _rss()
    t0 = time.monotonic()
    for epoch in range(epochs):
        ld = lazy if epoch % 2 else loader
        at = rng.randint(1, 16)
        how = ("break", "raise", "cancel")[epoch % 3]
        if how == "cancel":
            asyncio.run(_cancel_at(ld, at))
        else:
            _stop_sync(ld, how, at)
    took = time.monotonic() - t0
    gc.collect()
    check_leaks(baseline, deadline=10.0)
    grown = (_rss() - rss0) / (1 << 20)
    print(f"\nSOAK {epochs} stopped epochs in {took:.1f}s ({1000 * took / epochs:.0f} ms each); "
          f"RSS {rss0 / (1 << 20):.0f} MB -> {_rss() / (1 << 20):.0f} MB ({grown:+.1f} MB)")
    assert grown < 30, f"RSS grew by {grown:.1f} MB over {epochs} epochs"


async def _cancel_at(loader: aioloader.DataLoader, at: int) -> None:
    got = 0
    reached: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def consume() -> None:
        nonlocal got
        async for _ in loader:
            got += 1
            if got == at:
                reached.set_result(None)
                await asyncio.Event().wait()

    task = asyncio.create_task(consume())
    await asyncio.wait([task, reached], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[list-item]
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@pytest.mark.parametrize("consumer", ["async", "sync"])
def test_slow_consumer_holds_workers_back(consumer: str, tmp_path: Any) -> None:
    """An endless reader and a consumer that sleeps: the workers wait, nothing piles up."""
    progress = str(tmp_path / "progress")
    batch_size, num_workers, prefetch = 4, 2, 4
    loader = aioloader.DataLoader(CountingReader(progress, size=256 << 10),
                                  batch_size=batch_size, num_workers=num_workers,
                                  max_instances_in_memory=8, quiet=True)

    def read_progress() -> int:
        return max(int(open(f"{progress}.{k}").read() or 0) for k in range(num_workers))

    consumed = 0
    samples: list[int] = []
    rss: list[int] = []

    def on_batch() -> None:
        nonlocal consumed
        consumed += 1
        time.sleep(0.05)  # the slow consumer (not synchronisation)
        if consumed % 10 == 0:
            gc.collect()
            samples.append(read_progress())
            rss.append(_rss())

    async def run_async() -> None:
        async for _ in loader:
            on_batch()
            if consumed == 60:
                break

    if consumer == "async":
        asyncio.run(run_async())
    else:
        for _ in loader:
            on_batch()
            if consumed == 60:
                break
    # Every worker reads the whole stream and keeps 1 in num_workers (the loader shards),
    # so it reads num_workers * batch_size instances per batch of its own. It may be ahead
    # by its slots (prefetch) plus the batch it is building plus the lazy chunk.
    ahead = num_workers * batch_size * (prefetch + 2) + 8 * num_workers
    bound = num_workers * batch_size * (consumed // num_workers + 1) + ahead
    print(f"\nBOUNDED slow consumer {consumer}: progress {samples} after {consumed} "
          f"batches (bound {bound}); RSS MB {[r >> 20 for r in rss]}")
    assert samples[-1] <= bound, (samples, bound)
    assert (rss[-1] - rss[0]) < (30 << 20), rss
