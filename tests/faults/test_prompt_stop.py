"""Issue 19: stopping is prompt under load, whatever the workers are doing.

Workers stalled in user code that ignores EOF (a ``__getitem__`` that blocks: they say so
on a FIFO first, see ``victims.Stalls``) or waiting on a full arena (the consumer keeps the
epoch's batches waiting) are gone within STOP_BOUND seconds of an early stop (``break``),
a cancel, an exception in the consumer, or the consumer's death (kill -9), while CPU hogs
keep every core busy. The stop escalates (grace, SIGTERM, SIGKILL) on one schedule from
the stop request; a dead consumer's workers go by PR_SET_PDEATHSIG or, where their parent
is not the consumer (forkserver), by the watch on their socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import victims
from fault_helpers import (
    StallReports,
    arena_full,
    cpu_hog,
    ended,
    kill_9,
    read_line,
    start_script,
    survivors,
)

import aioloader
from aioloader.testing import descendants, describe_pids

STOP_BOUND = 10.0  # seconds from the stop to the last worker gone (GRACE and SIGTERM: ~1 s)
HOGS = 3  # spinning processes: a load of 5 or more on the 2 cores CI has


class Stop(Exception):
    """The consumer's own error."""


def _loader(stall: str, reports: StallReports | None) -> aioloader.DataLoader:
    if stall == "slow":
        assert reports is not None
        # 2 workers, batches of 2: each hands over two batches, then stalls in its third.
        return aioloader.DataLoader(victims.Stalls(10_000, 8, reports.path), batch_size=2,
                                    num_workers=2, quiet=True)
    return aioloader.DataLoader(victims.PlainReader(1_000_000), batch_size=2, num_workers=2,
                                max_instances_in_memory=8, quiet=True)


async def _stalled(loader: aioloader.DataLoader, reports: StallReports | None) -> list[int]:
    if reports is not None:
        return await asyncio.to_thread(reports.wait, 2)
    return await arena_full(loader)


async def _stop_async(loader: aioloader.DataLoader, reports: StallReports | None, how: str,
                      stop: dict[str, Any]) -> None:
    """Consume until the workers stall, then stop as ``how`` says; ``stop`` gets the worker
    pids and the time of the stop."""
    stalled = asyncio.Event()

    async def consume() -> None:
        async for _ in loader:
            if "pids" not in stop:
                stop["pids"] = await _stalled(loader, reports)
                stop["at"] = time.monotonic()
                if how == "break":
                    break
                if how == "raise":
                    raise Stop
                stalled.set()
                if reports is None:
                    await asyncio.Event().wait()  # parked in the body: the arena stays full
                # else on to the next batch, which never comes: cancelled waiting for it

    if how != "cancel":
        await consume()  # in the main coroutine: asyncio.run ends right after the stop
        return
    task = asyncio.create_task(consume())
    await stalled.wait()
    stop["at"] = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _stop_sync(loader: aioloader.DataLoader, reports: StallReports, how: str,
               stop: dict[str, Any]) -> None:
    for _ in loader:
        stop["pids"] = reports.wait(2)
        stop["at"] = time.monotonic()
        if how == "sync-break":
            break
        raise Stop


@pytest.mark.parametrize(("how", "stall"), [
    *[(how, stall) for how in ("break", "cancel", "raise") for stall in ("slow", "full")],
    ("sync-break", "slow"), ("sync-raise", "slow"),
])
def test_stalled_workers_end_promptly_after_a_stop(how: str, stall: str,
                                                   tmp_path: Path) -> None:
    reports = StallReports(str(tmp_path)) if stall == "slow" else None
    loader = _loader(stall, reports)
    stop: dict[str, Any] = {}
    try:
        with cpu_hog(HOGS):
            try:
                if how.startswith("sync"):
                    assert reports is not None
                    _stop_sync(loader, reports, how, stop)
                else:
                    # No wait_for around it: its task would make the stop happen in a task
                    # other than the main one, which asyncio.run waits for (the test's
                    # deadline catches a hang).
                    asyncio.run(_stop_async(loader, reports, how, stop))
            except Stop:
                pass
            returned = time.monotonic() - stop["at"]
            left = survivors(STOP_BOUND, pids=stop["pids"])
            gone = time.monotonic() - stop["at"]
    finally:
        loader.close()
        if reports is not None:
            reports.close()
    print(f"\nLATENCY stop {how} {stall} under {HOGS} hogs: returned {returned:.2f}s, "
          f"workers gone {gone:.2f}s after the stop")
    assert len(stop["pids"]) == 2
    assert not left, f"alive {STOP_BOUND}s after the stop: {describe_pids(left)}"


@pytest.mark.leaks_ok  # the victim's whole tree is checked here, helpers included
@pytest.mark.parametrize("stall", ["slow", "full"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_stalled_workers_of_a_killed_consumer_end_promptly(method: str, stall: str,
                                                           tmp_path: Path) -> None:
    with ended(start_script("stall_target.py", method, stall, tmp_path)) as proc:
        info = read_line(proc, timeout=90)
        tree = descendants(proc.pid)  # the workers, and the forkserver or tracker if any
        names = describe_pids(tree)
        assert set(info["workers"]) <= set(tree), (info, names)
        with cpu_hog(HOGS):
            left, gone = kill_9(proc, tree, STOP_BOUND)
    print(f"\nLATENCY kill -9 stalled {method} {stall} under {HOGS} hogs: "
          f"{names} gone {gone:.2f}s after the kill")
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"alive {STOP_BOUND}s after kill -9: {describe_pids(left)}"


def test_an_epoch_dropped_after_its_loop_ended_stops_its_workers() -> None:
    """Kept past its ``asyncio.run`` (by a traceback, say) and dropped later: nothing is
    left to run its close on, so it closes where it is dropped."""
    loader = _loader("full", None)
    kept: dict[str, Any] = {}

    async def first() -> None:
        kept["epoch"] = aiter(loader)
        await anext(kept["epoch"])

    try:
        asyncio.run(first())
        pids = [w.pid for w in loader.stats().workers if w.pid is not None]
        assert len(pids) == 2
        del kept["epoch"]
        assert not survivors(STOP_BOUND, pids=pids)
        assert len(list(zip(range(3), loader, strict=False))) == 3  # and it goes on
    finally:
        loader.close()
