"""Where a num_workers=0 fetch runs for ``async for`` (issue 23): the decision as plain state,
with made-up times; the loader's behaviour with real datasets is in test_caller_threads."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from aioloader._placement import (
    LIMIT,
    LOOP_RAN,
    MAX_PROOF,
    PROOF,
    WARM_UP,
    Placement,
    away,
    place,
    timed,
)

SHORT, LONG = LIMIT / 2, LIMIT * 5  # LONG: too long in the thread too


def saw(placement: Placement, times: int, wall: float = SHORT, *, on_loop: bool) -> None:
    for _ in range(times):
        placement.saw(wall, wall, on_loop=on_loop)


def proven() -> Placement:
    placement = Placement()
    saw(placement, PROOF, on_loop=False)
    return placement


def test_short_busy_fetches_in_a_row_move_to_the_loop() -> None:
    placement = Placement()
    for _ in range(PROOF - 1):
        saw(placement, 1, on_loop=False)
        assert not placement.inline
    saw(placement, 1, on_loop=False)
    assert placement.inline


@pytest.mark.parametrize(("wall", "cpu"), [(LONG, LONG), (SHORT, SHORT * 0.5)],
                         ids=["long", "waited"])
def test_a_long_or_waiting_fetch_starts_the_proof_again(wall: float, cpu: float) -> None:
    placement = Placement()
    saw(placement, PROOF - 1, on_loop=False)
    placement.saw(wall, cpu, on_loop=False)
    saw(placement, PROOF - 1, on_loop=False)
    assert not placement.inline
    placement.saw(SHORT, SHORT, on_loop=False)
    assert placement.inline


def test_a_fetch_that_waited_stays_in_the_thread_however_short() -> None:
    """A round trip to the caller's loop takes 30-50 us: a fetch that makes one would hang
    that loop if it ran there (it did, under a 50 us exemption: test_caller_threads)."""
    placement = Placement()
    for _ in range(PROOF * 4):
        placement.saw(20e-6, 5e-6, on_loop=False, waits=1)
    assert not placement.inline
    for _ in range(PROOF):  # one that was only taken off its core has not waited
        placement.saw(20e-6, 5e-6, on_loop=False, waits=0)
    assert placement.inline


def test_a_fetch_while_which_the_loop_ran_neither_proves_nor_disproves() -> None:
    """Its own counters said busy, but the loop ran meanwhile: the fetch may have waited for
    it unseen. The machine's load preempted the fetch's thread while the loop answered its
    round trip (no voluntary switch), and on the loop it hung (clean-clone CI of 9d54fbd,
    test_a_fetch_that_waits_never_runs_on_the_loop[awaits the loop]); or it was busy for
    most of its time and waited for the loop once."""
    placement = Placement()
    for _ in range(PROOF * 4):
        placement.saw(60e-6, 15e-6, on_loop=False, waits=0, loop=40e-6)
        placement.saw(SHORT, SHORT * 0.95, on_loop=False, waits=1, loop=40e-6)
    assert not placement.inline and placement.streak == 0
    for _ in range(PROOF):
        placement.saw(SHORT, SHORT, on_loop=False, waits=1, loop=LOOP_RAN / 2)
        placement.saw(SHORT, SHORT, on_loop=False, waits=0, loop=40e-6)  # not counted
    assert placement.inline


def warmed() -> Placement:
    """Proven, and past its first fetches on the loop (judged as a proof's)."""
    placement = proven()
    saw(placement, WARM_UP, LIMIT * 3, on_loop=True)
    assert placement.inline
    return placement


def back_after(placement: Placement, walls: list[float]) -> int | None:
    """How many busy fetches of ``walls`` ran on the loop before it sent them back."""
    for n, wall in enumerate(walls, 1):
        placement.saw(wall, wall, on_loop=True)
        if not placement.inline:
            return n
    return None


@pytest.mark.parametrize("how", ["waited", "busy far past twice", "busy past for good"])
def test_a_fetch_on_the_loop_past_the_bound_goes_back_for_a_longer_proof(how: str) -> None:
    placement = warmed()
    if how == "waited":
        placement.saw(LIMIT * 1.01, 0.0, on_loop=True)
    elif how == "busy far past twice":
        assert back_after(placement, [LONG, LONG]) == 2  # the first is let pass
    else:
        # Typical times past the bound: back within a few fetches, not at the first.
        assert back_after(placement, [LIMIT * 1.5] * 20) in range(4, 10)
    assert not placement.inline and placement.returns == 1
    saw(placement, PROOF * 4 - 1, on_loop=False)
    assert not placement.inline
    placement.saw(SHORT, SHORT, on_loop=False)
    assert placement.inline


def test_busy_fetches_that_spread_around_the_bound_stay_on_the_loop() -> None:
    """A batch's time spreads with the machine's load: single fetches past the bound (even
    far past it, one at a time) do not send a typical one back to the thread."""
    placement = warmed()
    spread = [LIMIT * x for x in (0.5, 1.4, 1.2, 0.5, 0.6, 0.7, 1.3, 0.6)] + [LONG] + [
        LIMIT * x for x in (0.5, 0.6, 0.5)]  # 0.87x the bound on average, two past in a row
    spread *= 20
    assert back_after(placement, spread) is None
    assert placement.returns == 0


def test_fetches_within_the_bound_on_the_loop_shorten_the_proof_again() -> None:
    placement = proven()
    placement.saw(LONG, 0.0, on_loop=True)
    assert placement.proof == PROOF * 4
    placement.inline = True  # proven again (32 fetches)
    saw(placement, PROOF * 4, on_loop=True)
    assert placement.proof == PROOF * 2
    saw(placement, PROOF * 2, on_loop=True)
    assert placement.proof == PROOF and placement.inline


def test_the_proof_grows_to_a_bound() -> None:
    placement = Placement()
    for _ in range(20):
        placement.inline, placement.streak = True, 0
        placement.saw(LONG, 0.0, on_loop=True)
    assert placement.proof == MAX_PROOF


async def test_place_runs_here_once_proven_and_a_failure_proves_nothing() -> None:
    threads: list[bool] = []
    offloaded = 0

    async def offload(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal offloaded
        offloaded += 1
        return await asyncio.to_thread(fn, *args)

    def fetch(fail: bool = False) -> int:
        threads.append(threading.current_thread() is threading.main_thread())
        if fail:
            raise KeyError("sample 7")
        return 1

    placement = Placement(limit=1.0, busy=0.0)  # any time proves, here
    for _ in range(PROOF + 2):
        assert await place(placement, offload, fetch) == 1
    assert threads == [False] * PROOF + [True] * 2 and offloaded == PROOF
    with pytest.raises(KeyError, match="sample 7"):
        await place(placement, offload, fetch, True)
    assert not placement.inline and placement.streak == 0


async def test_a_short_plan_moves_onto_the_loop_and_one_that_waits_stays_in_the_thread() -> None:
    """Each pass of a map-style loader is planned by ``Plans``: the first in a thread; once
    one proved short and busy, the next ones on the loop (no thread hop at each epoch's
    start). A plan that waits (a user's sampler reading something) stays in the thread."""
    from aioloader._producers import Plans
    from aioloader._session import PassDone

    here = threading.get_ident()
    where: list[int] = []

    def short(pass_no: int) -> list[list[int]]:
        where.append(threading.get_ident())
        return [[pass_no]]

    def waits(pass_no: int) -> list[list[int]]:
        where.append(threading.get_ident())
        # Idle (what a read does to a thread's CPU time), and within the plans' bound
        # (0.5 ms, 2 ms in the thread): the wait alone keeps it there.
        threading.Event().wait(LIMIT / 8)
        return [[pass_no]]

    for plan, on_loop in ((short, [False, True, True]), (waits, [False, False, False])):
        where.clear()
        plans = Plans(plan, 0, ahead=False)
        for pass_no in range(3):
            assert await plans.next() == [pass_no]
            assert isinstance(await plans.next(), PassDone)
        assert [w == here for w in where] == on_loop, plan.__name__


async def test_a_plan_kept_in_the_thread_is_made_while_the_pass_before_is_consumed() -> None:
    """The loader's own passes (``ahead``): the next pass's plan starts in the thread as soon
    as this one's is made, so the next epoch does not wait for a hop and a plan. A user's
    sampler (not ``ahead``) is planned when its epoch starts, after the user's
    ``set_epoch``. A close drops a plan made early."""
    from aioloader._producers import Plans
    from aioloader._session import PassDone

    started = [threading.Event() for _ in range(4)]
    asked: list[int] = []

    def waits(pass_no: int) -> list[list[int]]:  # it waits: plans stay in the thread
        asked.append(pass_no)
        started[pass_no].set()
        threading.Event().wait(LIMIT / 8)
        return [[pass_no], [pass_no]]

    plans = Plans(waits, 0, ahead=True)
    assert await plans.next() == [0]
    assert await asyncio.to_thread(started[1].wait, 60)  # while pass 0 is consumed
    assert await plans.next() == [0]
    assert isinstance(await plans.next(), PassDone)
    assert await plans.next() == [1]
    assert await asyncio.to_thread(started[2].wait, 60)
    plans.close()  # pass 2 is dropped, nobody waits for it
    assert asked == [0, 1, 2]

    asked.clear()
    plans = Plans(waits, 0, ahead=False)
    for pass_no in range(2):
        assert [await plans.next(), await plans.next()] == [[pass_no]] * 2
        assert isinstance(await plans.next(), PassDone)
        assert asked == list(range(pass_no + 1))  # nothing asked before the epoch starts
    assert asked == [0, 1]


def test_time_off_the_core_without_a_wait_is_not_waiting() -> None:
    """A loaded machine takes a thread off its core (involuntary switches): its CPU time
    falls short of its wall time, yet it waited for nothing. Only the thread's own waits
    (voluntary switches) make a fetch one that waited; uncounted (None), the ratio decides."""
    wall, cpu = LIMIT * 1.5, LIMIT * 0.5
    placement = Placement()
    for _ in range(PROOF):
        placement.saw(wall, cpu, waits=0, on_loop=False)
    assert placement.inline  # proven, though off its core half the time
    placement = warmed()
    placement.saw(wall, cpu, waits=0, on_loop=True)
    assert placement.inline  # busy: one past the bound is let pass
    placement.saw(wall, cpu, waits=1, on_loop=True)
    assert not placement.inline  # it waited: back at once
    placement = warmed()
    placement.saw(wall, cpu, waits=None, on_loop=True)
    assert not placement.inline


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"),
                    reason="waits are counted on Linux only")
def test_timed_counts_a_sleep_as_a_wait_and_a_computation_as_none() -> None:
    _, times = timed(threading.Event().wait, LIMIT)
    assert times.wall >= LIMIT and times.waits is not None and times.waits >= 1
    _, times = timed(sum, range(200_000))
    assert times.waits == 0 and times.cpu > 0


@pytest.mark.skipif(not hasattr(__import__("time"), "pthread_getcpuclockid"),
                    reason="another thread's CPU clock is read on Unix only")
async def test_away_sees_the_loop_run_for_a_call_that_waits_for_it() -> None:
    """:func:`away` watches the loop's thread: a call in another thread that waits for the
    loop sees it run; a computation while the loop idles does not."""
    loop = asyncio.get_running_loop()

    def round_trip() -> None:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result()

    _, times = await asyncio.to_thread(away(), round_trip)
    assert times.loop > LOOP_RAN
    idle = [(await asyncio.to_thread(away(), sum, range(20_000)))[1].loop for _ in range(20)]
    assert min(idle) <= LOOP_RAN, idle  # (a loaded machine may be slow to let the loop sleep)
    assert timed(sum, range(10))[1].loop == 0.0  # not watching


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's thread clock ids")
def test_timed_outlives_the_loop_thread_it_watches() -> None:
    """The caller's ``asyncio.run`` may return while its fetch still runs in the thread:
    reading the ended thread's clock fails (EINVAL), and the fetch must not. (Linux's id of
    a thread's CPU clock, ``~tid << 3 | 6``, here for a thread id above the kernel's
    largest, 2**22: a thread that cannot exist, where a joined one may not have ended yet.)"""
    assert time.pthread_getcpuclockid(threading.get_ident()) == ~threading.get_native_id() << 3 | 6
    gone = ~(2**22 + 1) << 3 | 6
    out, times = timed(sum, range(1000), watch=gone)
    assert out == sum(range(1000)) and times.loop == 0.0


def test_timed_takes_a_call_within_quick_as_busy_and_reads_a_longer_one() -> None:
    _, times = timed(sum, range(10), quick=1.0)
    assert (times.cpu, times.waits) == (times.wall, 0)
    _, times = timed(threading.Event().wait, 2 * LIMIT, quick=LIMIT)
    assert times.wall >= 2 * LIMIT and times.cpu < times.wall / 2
    assert times.waits is None or times.waits >= 1
