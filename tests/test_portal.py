"""The sync adapter's portal (``aioloader.run._portal``): a coroutine run to its end per call, on a
loop kept between calls, which the call's coroutine stops itself in the turn that ends it."""

from __future__ import annotations

import asyncio

import pytest

from aioloader.run._portal import Portal


async def _after_turns(n: int) -> int:
    for _ in range(n):
        await asyncio.sleep(0)
    return n


async def _raises() -> None:
    await asyncio.sleep(0)
    raise KeyError("inside")


def test_calls_return_their_results_and_raise_their_errors() -> None:
    portal = Portal()
    try:
        assert portal.call(_after_turns(0)) == 0
        assert portal.call(_after_turns(3)) == 3
        with pytest.raises(KeyError, match="inside"):
            portal.call(_raises())
        assert portal.call(_after_turns(1)) == 1
    finally:
        portal.close()


def test_a_call_runs_to_its_end_when_something_else_stops_the_loop() -> None:
    """A stop left over for the next run (``run_until_complete``'s callback, when a task's
    end stopped the loop first) ends that run early: the call goes on to its result."""
    portal = Portal()
    try:
        assert portal.call(_after_turns(0)) == 0
        assert portal.loop is not None
        portal.loop.call_soon(portal.loop.stop)
        assert portal.call(_after_turns(5)) == 5
        assert portal.call(_after_turns(2)) == 2
    finally:
        portal.close()


def test_a_backstop_handed_from_a_thread_the_driver_waits_for_does_not_wait() -> None:
    """A collection in a thread the driver awaits (a close's reaping thread) finalized a
    dropped epoch, whose backstop asked the driver to close it and waited: neither wait
    ended (issue 32's new tests hung 1 run in 4 on it). ``hand`` returns at once; the
    driver runs the close before it lets go."""
    portal = Portal()
    ran: list[str] = []
    reaped = asyncio.Event()  # the close's wait for its reaping thread, as it were

    async def closing() -> None:  # a dropped epoch's close: it waits for that close
        await reaped.wait()
        ran.append("closed")

    def collecting() -> str:
        portal.hand(closing())  # (``call`` waited here for ``closing``: forever)
        return "handed"

    async def step() -> str:
        handed = await asyncio.to_thread(collecting)
        reaped.set()
        return handed

    try:
        assert portal.call(step()) == "handed"
        assert ran == ["closed"]
    finally:
        portal.close()
