"""The supervisor in-process: a worker's phases as pure transitions (aioloader/workers/_phases.py),
and a real Supervisor driven over real sockets by scripted fake workers (no process)."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass, replace
from typing import Any, cast

import pytest

from aioloader._errors import LoaderClosedError, WorkerDied, WorkerError
from aioloader.plane import _wire as wire
from aioloader.plane._dataplane import Shelf
from aioloader.plans._sources import Kind
from aioloader.workers import _supervisor
from aioloader.workers._phases import (
    Phase,
    RestartBudget,
    Roster,
    StartSuccessor,
    Switch,
    Wait,
    WorkerLost,
    WorkerState,
)
from aioloader.workers._steps import Delivered
from aioloader.workers._supervising import Ended
from aioloader.workers._supervisor import Supervisor

pytestmark = pytest.mark.deadline(30)

POSITION = [0, 1, 2, None, 3]  # a stream's ShardPosition as data: opaque here


def roster(n: int = 2, restarts: int = 0) -> Roster[str]:
    r: Roster[str] = Roster(RestartBudget(restarts))
    for k in range(n):
        r.workers.append(WorkerState(k, f"worker {k}", phase=Phase.RUNNING))
    return r


def batch(seq: int, slot: int = 0) -> wire.Batch:
    return wire.Batch(slot, seq, 0, None)


def start_successor(r: Roster[str], action: StartSuccessor | None) -> WorkerState[str]:
    """What the supervisor does for StartSuccessor: a new worker, submitted for starting."""
    assert isinstance(action, StartSuccessor)
    new = WorkerState(action.worker_id, f"successor of {action.worker_id}")
    r.add_successor(r.workers[action.worker_id], new)
    return new


def died(worker_id: int) -> WorkerDied:
    return WorkerDied(worker_id, 1000 + worker_id, -9)


# ---------------------------------------------------------------------- pure transitions

def test_batches_are_delivered_in_their_order_then_the_consumer_waits() -> None:
    r = roster()
    w = r.workers[0]
    for msg in (batch(0), batch(2, slot=1), wire.PassEnd(0, 0, 2)):
        assert r.on_message(w, msg) is None
    assert r.next_step(0) == batch(0)
    assert r.next_step(0) == batch(2, slot=1)
    assert r.next_step(0) == wire.PassEnd(0, 0, 2)
    assert r.next_step(0) == Wait()
    assert r.next_step(1) == Wait()


def test_a_stream_worker_recycles_after_its_last_batches() -> None:
    r = roster()
    w = r.workers[0]
    r.on_message(w, batch(0))
    new = start_successor(r, r.on_message(w, wire.Retiring(POSITION)))
    assert w.phase is Phase.RETIRING and new.phase is Phase.STARTING
    assert r.budget.recycles == 1
    assert r.next_step(0) == batch(0)  # the batches sent before it come first
    assert r.next_step(0) == Switch(0)  # the hand-over read: the successor takes over
    assert w.phase is Phase.HANDED_OVER
    assert r.switched(0) is None
    assert r.workers[0] is new and new.phase is Phase.RUNNING
    assert w.phase is Phase.RETIRED and w.successor is None


def test_an_index_worker_hands_its_unanswered_tasks_to_its_successor() -> None:
    r = roster()
    w = r.workers[0]
    assert r.request(0, 0, [0, 1])
    assert r.request(0, 2, [4, 5])
    r.on_message(w, batch(0))
    new = start_successor(r, r.on_message(w, wire.Retiring(None)))
    assert w.phase is Phase.HANDED_OVER  # new tasks go to the successor from now on
    assert not r.request(0, 4, [8, 9])
    assert r.next_step(0) == batch(0)
    w.took(batch(0))
    assert r.next_step(0) == Switch(0)
    r.switched(0)
    assert new.sent == {2: [4, 5], 4: [8, 9]}  # re-sent to it, in order
    assert r.request(0, 6, [12, 13])


def test_one_hand_over_at_a_time_the_next_starts_after_the_switch() -> None:
    r = roster()
    w0, w1 = r.workers
    start_successor(r, r.on_message(w0, wire.Retiring(POSITION)))
    assert r.on_message(w1, wire.Retiring(POSITION)) is None  # deferred
    assert w1.deferred and w1.phase is Phase.RETIRING
    assert r.next_step(0) == Switch(0)
    then = r.switched(0)
    assert then == StartSuccessor(1, POSITION)
    start_successor(r, then)
    assert not w1.deferred
    assert r.budget.recycles == 2


def test_a_rewind_is_answered_after_what_was_sent_before_it() -> None:
    r = roster()
    w = r.workers[0]
    r.on_message(w, batch(0))
    assert r.rewind(0, 3) == [w]  # asked now
    r.on_message(w, wire.Rewound(3))
    r.on_message(w, batch(0, slot=1))  # pass 3's first
    assert w.rewinding is None  # answered: a successor it starts later is asked nothing
    assert r.next_step(0) == batch(0)  # the pass dropped: the consumer drops it
    assert r.next_step(0) == wire.Rewound(3)
    assert r.next_step(0) == batch(0, slot=1)


def test_a_rewind_asked_of_a_retiring_stream_worker_is_its_successors_to_answer() -> None:
    # it said Retiring before it saw the rewind: its successor starts where it stopped, in
    # the pass dropped, and is asked too (now, or as it starts), before its first batch
    r = roster()
    w0, w1 = r.workers
    s0 = start_successor(r, r.on_message(w0, wire.Retiring(POSITION)))
    assert r.on_message(w1, wire.Retiring(POSITION)) is None  # deferred: not started
    assert r.rewind(0, 3) == [w0, s0]
    assert r.rewind(1, 3) == [w1]
    assert r.next_step(0) == Switch(0)
    s1 = start_successor(r, r.switched(0))  # w1's, deferred until now
    assert s1.rewinding == 3  # asked as it starts
    r.on_message(s0, wire.Rewound(3))
    assert r.next_step(0) == wire.Rewound(3)
    assert r.workers[0] is s0 and s0.rewinding is None


def test_a_deferred_stream_hand_over_starts_when_the_consumer_reaches_it() -> None:
    r = roster()
    w0, w1 = r.workers
    start_successor(r, r.on_message(w0, wire.Retiring(POSITION)))
    r.on_message(w1, wire.Retiring(POSITION))
    # The consumer needs worker 1 now: past its hand-over, nothing else comes from it.
    assert r.next_step(1) == StartSuccessor(1, POSITION)
    start_successor(r, StartSuccessor(1, POSITION))
    assert r.next_step(1) == Switch(1)


def test_a_deferred_index_hand_over_starts_when_its_tasks_are_waited_for() -> None:
    r = roster()
    w0, w1 = r.workers
    start_successor(r, r.on_message(w0, wire.Retiring(None)))
    r.request(1, 1, [2, 3])  # sent to it; it answers no more
    assert r.on_message(w1, wire.Retiring(None)) is None
    assert w1.phase is Phase.RETIRING
    assert r.next_step(1) == StartSuccessor(1, None)
    assert w1.phase is Phase.HANDED_OVER
    start_successor(r, StartSuccessor(1, None))
    assert r.next_step(1) == Switch(1)


def test_a_worker_that_dies_is_lost_after_what_it_sent_then_restarted() -> None:
    r = roster(restarts=1)
    w = r.workers[0]
    r.on_message(w, batch(0))
    assert r.on_exit(w) is True
    r.on_death(w, died(0))
    assert w.phase is Phase.LOST and r.failure is None
    assert r.next_step(0) == batch(0)
    step = r.next_step(0)
    assert isinstance(step, WorkerLost)
    assert r.next_step(1) == Wait()  # the others go on
    new = WorkerState(0, "restarted")
    death, gone = r.restart(0, new)
    assert death is w.died and gone == [w] and w.phase is Phase.RETIRED
    assert r.workers[0] is new and r.budget.restarts == 1
    r.started(new)
    assert new.phase is Phase.RUNNING


def test_a_silent_worker_is_hung_only_when_silent_itself_and_healable() -> None:
    """Issue 33: the worker the consumer waits for is killed as hung when it is running,
    has been silent ``silence`` seconds itself, and the budget can heal one more death;
    its death is then counted as a hang."""
    r = roster(restarts=1)
    w = r.workers[0]
    now = w.heard + 10.0
    assert r.hung(0, 20.0, now) is None  # heard 10 s ago: not silent long enough
    r.workers[1].phase = Phase.STARTING
    assert r.hung(1, 5.0, now) is None  # not running yet: its start is no silence
    assert r.hung(0, 5.0, now) is w and w.silenced == 10.0
    assert r.hung(0, 5.0, now) is None  # killed once
    assert r.on_exit(w) is True
    r.on_death(w, WorkerDied(0, 1000, -9, hung=w.silenced))
    assert isinstance(r.next_step(0), BaseException)
    r.restart(0, WorkerState(0, "restarted", phase=Phase.RUNNING))
    assert r.budget.healed == {"hang": 1} and r.budget.restarts == 1
    assert r.workers[0].died is None and not r.budget.room
    assert r.hung(0, 5.0, r.workers[0].heard + 10.0) is None  # the budget is spent
    assert "hung (no word for 10.0 s while a batch was owed)" in str(r.budget.deaths[0])


def test_a_death_past_the_budget_fails_the_session() -> None:
    r = roster(restarts=1)
    for k in (0, 1):
        assert r.on_exit(r.workers[k]) is True
        r.on_death(r.workers[k], died(k))
    assert r.workers[0].phase is Phase.LOST
    assert r.workers[1].phase is Phase.EXITED
    assert isinstance(r.failure, WorkerDied) and r.failure.earlier == [r.workers[0].died]
    assert r.next_step(0) is r.failure


def test_a_lost_retiring_worker_takes_its_successor_with_it() -> None:
    r = roster(restarts=1)
    w = r.workers[0]
    successor = start_successor(r, r.on_message(w, wire.Retiring(POSITION)))
    assert r.on_exit(w) is True
    r.on_death(w, died(0))
    step = r.next_step(0)  # the hand-over message is read first: it stays lost
    assert isinstance(step, WorkerLost)
    _, gone = r.restart(0, WorkerState(0, "restarted"))
    assert gone == [w, successor] and successor.phase is Phase.RETIRED


def test_a_failure_is_raised_in_its_turn_and_its_exit_is_no_death() -> None:
    r = roster()
    w0, w1 = r.workers
    error = WorkerError("worker 0 raised KeyError", worker_id=0)
    r.on_message(w0, batch(0))
    r.on_message(w0, error)
    assert w0.phase is Phase.FAILED
    assert r.on_exit(w0) is False and w0.phase is Phase.EXITED
    assert r.next_step(1) == Wait()  # not yet: it is worker 0's turn to raise it
    assert r.next_step(0) == batch(0)
    assert r.next_step(0) is error
    assert r.failure is error and r.next_step(1) is error
    assert r.on_exit(w1) is False  # the session failed: nothing to heal


def test_close_retires_everyone_once() -> None:
    r = roster()
    w0, w1 = r.workers
    successor = start_successor(r, r.on_message(w0, wire.Retiring(POSITION)))
    r.on_message(w1, batch(0))
    assert r.close() == [w0, w1, successor]
    assert all(w.phase is Phase.RETIRED for w in (w0, w1, successor))
    assert r.close() is None
    step = r.next_step(1)
    assert isinstance(step, LoaderClosedError)
    assert r.on_exit(w1) is False
    assert r.on_message(w1, wire.Retiring(POSITION)) is None


def test_a_switch_that_ends_after_a_close_starts_nothing() -> None:
    r = roster()
    w0, w1 = r.workers
    new = start_successor(r, r.on_message(w0, wire.Retiring(POSITION)))
    r.on_message(w1, wire.Retiring(POSITION))
    r.close()
    assert r.switched(0) is None and new.phase is Phase.RETIRED


def test_the_budget_names_the_earlier_deaths() -> None:
    budget = RestartBudget(1)
    assert budget.spend(died(0)) is None
    fatal = budget.spend(died(1))
    assert fatal is not None and "max_worker_restarts=1" in str(fatal)
    assert fatal.earlier == budget.deaths[:1] and len(fatal.deaths) == 2


# ---------------------------------------------------------------------- a real supervisor

@dataclass(frozen=True)
class FakeWorkers:
    """What the supervisor reads of a spec's config part."""

    num_workers: int = 2
    slots: int = 2
    threaded: bool = True
    start_method: str = "fork"
    zero_copy: bool = True


@dataclass(frozen=True)
class FakeSpec:
    """What the supervisor reads of a thread worker's spec."""

    worker_id: int = 0
    workers: FakeWorkers = FakeWorkers()
    kind: Kind = Kind.MAP  # own_source shares a map-style source

    def for_worker(self, k: int) -> FakeSpec:
        return replace(self, worker_id=k)

    def starting_at(self, start: Any) -> FakeSpec:
        return self


class FakeWorker:
    """Stands in for ``ThreadWorker``: the test speaks for the worker over its socket, and
    ends it by closing its sentinel pipe's write end."""

    made: list[FakeWorker] = []

    def __init__(self, spec: FakeSpec, sock: socket.socket, shelf: Shelf, name: str) -> None:
        self.spec, self.sock, self.shelf = spec, sock, shelf
        self.pid: int | None = os.getpid()
        self.exitcode: int | None = None
        self.sentinel = -1
        self._done = -1
        self.started = False
        FakeWorker.made.append(self)

    def start(self) -> None:
        self.sentinel, self._done = os.pipe()
        self.started = True

    def say(self, msg: wire.Message, batch: Any = None) -> None:
        if isinstance(msg, wire.Batch):
            self.shelf.items[msg.slot] = batch
        self.sock.sendall(wire.encode(msg))

    def heard(self) -> list[wire.Message]:
        self.sock.setblocking(False)
        try:
            return wire.FrameReader().feed(self.sock.recv(1 << 16))
        except BlockingIOError:
            return []

    def exit(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
            self.sock.close()
            os.close(self._done)

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.exit(-15)

    def kill(self) -> None:
        self.exit(-9)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> list[FakeWorker]:
    FakeWorker.made = []
    monkeypatch.setattr(_supervisor, "ThreadWorker", FakeWorker)
    return FakeWorker.made


def supervisor(restarts: int = 0) -> Supervisor:
    return Supervisor(cast(Any, FakeSpec()), budget=RestartBudget(restarts))


def test_a_supervisor_delivers_in_order_restarts_a_death_and_recycles(
        fakes: list[FakeWorker]) -> None:
    async def main() -> None:
        sup = supervisor(restarts=1)
        await sup.start()
        sup.attach()
        w0, w1 = fakes
        sup.request(0, 0, [0, 1])
        assert w0.heard() == [wire.Task(0, [0, 1])]
        w0.say(wire.Batch(0, 0, 0, None), "b0")
        assert await sup.receive(0) == Delivered("b0", 0, None, 0)
        assert w0.heard() == [wire.Release(0)]  # taken by reference: its slot goes back

        # A death without a word: what it sent comes first, then a restart heals it.
        w1.say(wire.Batch(1, 1, 0, None), "b1")
        w1.exit(-9)
        assert await sup.receive(1) == Delivered("b1", 1, None, 0)
        with pytest.raises(WorkerLost):
            await sup.receive(1)
        await sup.restart(1)
        w1b = fakes[2]
        w1b.say(wire.PassEnd(0, 0, 1))
        assert await sup.receive(1) == Ended(0)
        assert sup.budget.restarts == 1 and sup.workers[1].phase is Phase.RUNNING

        # Recycling a stream worker: the successor starts at once, takes over after.
        w0.say(wire.Batch(1, 2, 0, None), "b2")
        w0.say(wire.Retiring([0, 0, 4, None, 1]))  # ShardPosition.to_data()
        assert await sup.receive(0) == Delivered("b2", 2, None, 0)
        successor = fakes[3]
        successor.say(wire.Batch(0, 3, 0, None), "b3")
        assert await sup.receive(0) == Delivered("b3", 3, None, 0)
        assert sup.workers[0].link.process is successor and sup.budget.recycles == 1
        await sup.aclose(0.0)
        assert all(f.exitcode is not None for f in fakes)  # each one stopped and closed
        assert all(w.phase is Phase.REAPED for w in sup.workers)

    asyncio.run(main())


def test_a_death_seen_just_before_the_timeout_keeps_the_wait_healing(
        fakes: list[FakeWorker]) -> None:
    """The worker the consumer waits for dies within the budget, and the session's timer
    fires in the same turn of the loop, after the exit was read but before the woken
    consumer runs to restart it: that is healing, not a timeout (a chaos run under load
    timed out an epoch this way, 1 in 200 hangs)."""
    async def main() -> None:
        sup = supervisor(restarts=1)
        await sup.start()
        sup.attach()
        w1 = fakes[1]
        sup.request(1, 1, [2, 3])
        waiting = asyncio.create_task(sup.receive(1))
        await asyncio.sleep(0)  # it waits for worker 1
        w1.exit(-9)
        sup._on_exit(sup.workers[1])  # the sentinel's callback: the exit is read
        assert sup.workers[1].phase is Phase.LOST
        assert sup.heal(2.0)  # the timer, before the consumer's turn
        with pytest.raises(WorkerLost):
            await waiting
        await sup.restart(1)
        fakes[2].say(wire.Batch(0, 1, 0, None), "b1")
        assert await sup.receive(1) == Delivered("b1", 1, None, 0)
        await sup.aclose(0.0)

    asyncio.run(main())


def test_a_supervisor_raises_a_failure_in_its_turn(fakes: list[FakeWorker]) -> None:
    async def main() -> None:
        sup = supervisor()
        await sup.start()
        sup.attach()
        w0, w1 = fakes
        w1.shelf.error = KeyError("k")
        w1.say(wire.Failed("KeyError('k')", "Traceback: ...", None))
        w1.exit(1)
        w0.say(wire.Batch(0, 0, 0, None), "b0")
        assert await sup.receive(0) == Delivered("b0", 0, None, 0)
        with pytest.raises(KeyError) as caught:
            await sup.receive(1)
        assert isinstance(caught.value, WorkerError) and caught.value.__cause__ is not None
        with pytest.raises(WorkerError):  # the session's failure from now on
            await sup.receive(0)
        assert sup.budget.deaths == []  # its exit, after its Failed, is no death
        await sup.aclose(0.0)
        with pytest.raises(KeyError):
            await sup.receive(0)

    asyncio.run(main())


def test_a_closed_supervisor_says_so(fakes: list[FakeWorker]) -> None:
    async def main() -> None:
        sup = supervisor()
        await sup.start()
        sup.attach()
        sup.close(0.0)
        with pytest.raises(LoaderClosedError):
            await sup.receive(0)
        assert all(f.exitcode is not None and f.sentinel == -1 for f in fakes)

    asyncio.run(main())
