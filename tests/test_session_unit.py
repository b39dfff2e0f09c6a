"""In-process tests of the middle: a Session over a fake producer, and a Run's phases.

No worker process and no DataLoader face: the session is driven with a producer whose steps
the test hands it, and the run with an in-process (num_workers=0) config.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import aioloader
from aioloader import LoaderClosedError, LoaderTimeoutError
from aioloader._stats import NO_ARENA, ArenaStats, WorkerStats
from aioloader.run._run import Phase, Run
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


# ------------------------------------------------------------------ the run's phases


class Token:
    """An epoch, as the run sees one."""

    def __init__(self) -> None:
        self.abandoned = self.superseded = self.waiting = False

    def abandon(self, superseded: bool = False) -> None:
        self.abandoned, self.superseded = True, superseded


def make_run(**options: Any) -> Run:
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, quiet=True, seed=3, **options)
    return Run(loader.config)


async def epoch_values(run: Run, token: Token) -> list[list[int]]:
    session = await run.begin(token, private=False)
    got = []
    while (step := await run.next(session)) is not None:
        got.append(step.value.tolist())
    await run.end(token, session, stop=False)
    return got


async def test_a_complete_epoch_goes_idle_and_keeps_its_session() -> None:
    run = make_run()
    assert run.phase is Phase.IDLE
    token = Token()
    session = await run.begin(token, private=False)
    assert run.phase is Phase.IN_EPOCH and run.is_current(token)
    values = []
    while (step := await run.next(session)) is not None:
        values.append(step.value.tolist())
    assert values == [[0, 1], [2, 3], [4, 5]]
    await run.end(token, session, stop=False)
    assert run.phase is Phase.IDLE and not run.in_epoch()
    assert run.session_is(session) and not session.closed  # kept for the next epoch
    await run.aclose()
    assert run.phase is Phase.CLOSED and session.closed


async def test_an_epoch_closed_after_its_last_batch_owes_its_pass_end() -> None:
    run = make_run(shuffle=True)
    first = Token()
    session = await run.begin(first, private=False)
    taken = [await run.next(session) for _ in range(3)]  # all of them, not the end
    assert all(step is not None for step in taken)
    await run.leave(first, session)
    assert run.phase is Phase.PASS_OWED and not session.closed
    second = await epoch_values(run, Token())  # takes the owed pass end first
    assert run.phase is Phase.IDLE
    again = make_run(shuffle=True)
    await epoch_values(again, Token())
    assert second == await epoch_values(again, Token())  # pass 1, as an uninterrupted run
    await run.aclose()
    await again.aclose()


async def test_a_second_epoch_while_one_waits_for_a_batch_is_refused() -> None:
    run = make_run()
    token = Token()
    session = await run.begin(token, private=False)
    assert await run.next(session) is not None
    token.waiting = True  # its consumer, in another task, waits for a batch
    with pytest.raises(aioloader.LoaderBusyError):
        await run.begin(Token(), private=False)
    assert run.is_current(token) and not token.abandoned
    await run.end(token, session, stop=True, grace=0.0)
    assert session.closed and run.phase is Phase.IDLE
    await run.aclose()


async def test_a_second_epoch_supersedes_one_half_consumed() -> None:
    run = make_run()
    first, second = Token(), Token()
    session = await run.begin(first, private=False)
    assert await run.next(session) is not None
    again = await run.begin(second, private=False)
    assert first.abandoned and first.superseded and run.is_current(second)
    got = []
    while (step := await run.next(again)) is not None:
        got.append(step.value.tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]  # the pass again, from its start
    await run.end(second, again, stop=False)
    await run.aclose()


async def test_a_close_from_another_thread_ends_the_epoch_in_progress() -> None:
    run = make_run(batches_per_epoch=10**6)  # an epoch that never ends by itself
    token = Token()
    session = await run.begin(token, private=False)
    assert await run.next(session) is not None
    closer = threading.Thread(target=run.close)
    closer.start()
    with pytest.raises(LoaderClosedError):
        while True:  # steps until the close reaches the session
            await asyncio.wait_for(run.next(session), 30)
    await asyncio.to_thread(closer.join)
    await run.end(token, session, stop=True, grace=0.0)
    assert run.phase is Phase.CLOSED and session.closed


def epoch_of(loader: aioloader.DataLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def fresh(epoch: int) -> list[list[int]]:
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    loader.set_epoch(epoch)
    with loader:
        return epoch_of(loader)


def owing(loader: aioloader.DataLoader) -> None:
    """Take all of an epoch's batches and close it without asking for its end (as
    Lightning and zip() do): its pass end is owed."""
    it = iter(loader)
    assert [next(it).tolist() for _ in range(3)] == fresh(0)
    it.close()  # type: ignore[attr-defined]


def test_a_close_with_a_pass_end_owed_then_set_epoch_counts_the_pass_once() -> None:
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    owing(loader)
    loader.close()
    loader.set_epoch(1)  # Lightning's call before the next epoch
    with loader:
        assert epoch_of(loader) == fresh(1)


def test_a_loaded_state_is_where_the_next_epoch_starts_even_with_a_pass_end_owed() -> None:
    source = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    with source:
        it = iter(source)
        next(it)
        state = source.state_dict()  # after epoch 0's first batch
        it.close()  # type: ignore[attr-defined]
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    owing(loader)
    loader.load_state_dict(state)
    with loader:
        assert epoch_of(loader) == fresh(0)[1:]
