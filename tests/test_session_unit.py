"""In-process tests of the middle: a Session over a fake producer (a Run's phases:
test_run_phases.py).

No worker process and no DataLoader face: the session is driven with a producer whose steps
the test hands it, and the run with an in-process (num_workers=0) config.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aioloader import LoaderClosedError, LoaderTimeoutError
from aioloader._stats import NO_ARENA, ArenaStats, WorkerStats
from aioloader.run._session import Session, State
from aioloader.workers._steps import Delivered, PassDone, Step


class FakeProducer:
    """A producer whose steps come from the test (``put``), and which records its life."""

    def __init__(self, *, fail_start: BaseException | None = None) -> None:
        self.steps: asyncio.Queue[Step] = asyncio.Queue()
        self.fail_start = fail_start
        self.activity = time.monotonic()
        self.events: list[str] = []
        self.closed_with: float | None = None
        self.heals = 0
        self.healed = asyncio.Event()

    async def start(self) -> None:
        self.events.append("start")
        if self.fail_start is not None:
            raise self.fail_start

    async def next(self) -> Step:
        return await self.steps.get()

    def behind(self) -> str:
        return "the fake producer"

    def last_activity(self) -> float:
        return self.activity

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        return (), NO_ARENA

    def attach(self, private: bool) -> None:
        self.events.append("attach")

    def detach(self) -> None:
        self.events.append("detach")

    def heal(self, silence: float) -> bool:
        """True ``heals`` times (a hung worker killed), then False (the wait times out)."""
        self.events.append("heal")
        self.healed.set()
        if self.heals:
            self.heals -= 1
            return True
        return False

    async def aclose(self, grace: float) -> None:
        self.events.append("aclose")
        self.closed_with = grace

    def close(self, grace: float) -> None:
        self.events.append("close")
        self.closed_with = grace


async def started(producer: FakeProducer) -> Session:
    session = Session(producer)
    await session.start()
    session.attach()
    return session


async def test_steps_come_in_order_and_the_session_is_idle_between_them() -> None:
    producer = FakeProducer()
    session = await started(producer)
    assert session.state is State.IDLE
    for step in (Delivered("a"), Delivered("b"), PassDone(empty=False)):
        producer.steps.put_nowait(step)
    assert [await session.next(), await session.next(), await session.next()] == [
        Delivered("a"), Delivered("b"), PassDone(empty=False)]
    assert session.state is State.IDLE
    await session.aclose(0.5)
    assert session.state is State.CLOSED and producer.closed_with == 0.5
    with pytest.raises(LoaderClosedError):
        await session.next()


async def test_a_close_from_another_thread_wakes_the_waiting_consumer() -> None:
    producer = FakeProducer()
    session = await started(producer)
    consumer = asyncio.ensure_future(session.next())
    await asyncio.sleep(0)  # the consumer is inside next(), waiting for a step
    assert session.state is State.RUNNING
    closer = threading.Thread(target=session.close, args=(0.0,))
    closer.start()
    with pytest.raises(LoaderClosedError, match="another task or thread"):
        await asyncio.wait_for(consumer, 30)
    await asyncio.to_thread(closer.join)
    assert session.closed and producer.events[-1] == "close"


async def test_silence_past_the_timeout_names_what_it_waits_for() -> None:
    producer = FakeProducer()
    session = await started(producer)
    with pytest.raises(LoaderTimeoutError, match="the fake producer"):
        await asyncio.wait_for(session.next(timeout=0.05), 30)
    assert session.state is State.IDLE  # a timeout ends the wait, not the session
    producer.steps.put_nowait(Delivered(1))
    assert await session.next(timeout=30) == Delivered(1)
    await session.aclose(0.0)


async def test_a_healed_silence_keeps_the_consumer_waiting() -> None:
    """Issue 33: when the producer heals the silence (a hung worker killed and replaced),
    the wait goes on; the step that comes next is the consumer's."""
    producer = FakeProducer()
    producer.heals = 1
    session = await started(producer)
    consumer = asyncio.ensure_future(session.next(timeout=0.05))
    await asyncio.wait_for(producer.healed.wait(), 30)
    producer.steps.put_nowait(Delivered(1))
    assert await asyncio.wait_for(consumer, 30) == Delivered(1)
    assert producer.events.count("heal") == 1
    producer.heals = 1  # healed once, then silent again: the second silence times out
    with pytest.raises(LoaderTimeoutError, match="the fake producer"):
        await asyncio.wait_for(session.next(timeout=0.05), 30)
    assert producer.events.count("heal") == 3
    await session.aclose(0.0)


async def test_the_consumers_own_cancel_stays_a_cancel() -> None:
    session = await started(FakeProducer())
    consumer = asyncio.ensure_future(session.next())
    await asyncio.sleep(0)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert not session.closed
    await session.aclose(0.0)


async def test_a_failed_start_closes_the_producer_without_grace() -> None:
    producer = FakeProducer(fail_start=OSError("no room"))
    session = Session(producer)
    with pytest.raises(OSError, match="no room"):
        await session.start()
    assert session.state is State.CLOSED and producer.closed_with == 0.0
