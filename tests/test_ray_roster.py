"""RaySupervisor on the Roster, in-process: fake actors whose calls the test answers, no
cluster. A reply, a recycle and a death are the Roster's events, as a process worker's are
(tests/test_supervisor_unit.py drives the same transitions over sockets)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

ray = pytest.importorskip("ray")

from aioloader._errors import BatchFailure, LoaderClosedError, WorkerDied  # noqa: E402
from aioloader.plane import _wire as wire  # noqa: E402
from aioloader.plans._position import ShardPosition  # noqa: E402
from aioloader.workers import _ray, _ray_cluster  # noqa: E402
from aioloader.workers._phases import Phase, RestartBudget, WorkerLost  # noqa: E402
from aioloader.workers._ray import RaySupervisor  # noqa: E402
from aioloader.workers._ray_actor import Built, Hello, PassOver, Retire  # noqa: E402
from aioloader.workers._steps import Delivered  # noqa: E402
from aioloader.workers._supervising import Ended, Rewound  # noqa: E402

pytestmark = pytest.mark.deadline(30)


class Ref:
    """An ObjectRef: awaitable, with Ray's ``future()``; the test resolves it."""

    def __init__(self) -> None:
        self.fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.fut).__await__()

    def future(self) -> concurrent.futures.Future[Any]:
        return self.fut

    def answer(self, reply: Any) -> None:
        self.fut.set_result(reply)

    def die(self) -> None:
        self.fut.set_exception(ray.exceptions.RayActorError())


class Method:
    def __init__(self, actor: Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Ref:
        ref = Ref()
        self.actor.calls.append((self.name, args, ref))
        if self.name == "hello":  # it says where it runs at once
            ref.answer(Hello("node", "host", 1000 + self.actor.worker_id))
        return ref


class Actor:
    """A fake actor handle: its calls, in order, each answered by the test."""

    def __init__(self, worker_id: int, start: ShardPosition | None) -> None:
        self.worker_id, self.start = worker_id, start
        self.calls: list[tuple[str, tuple[Any, ...], Ref]] = []
        self._actor_id = types.SimpleNamespace(hex=lambda: f"actor{id(self):x}")
        self.hello, self.next, self.fetch, self.rewind = (
            Method(self, n) for n in ("hello", "next", "fetch", "rewind"))
        self.killed = False

    def asked(self, name: str) -> list[tuple[tuple[Any, ...], Ref]]:
        return [(args, ref) for n, args, ref in self.calls if n == name]

    def numbered(self) -> list[tuple[str, int]]:
        """Its calls but hello, with the number that sets their order in the actor."""
        return [(n, args[0]) for n, args, _ in self.calls if n != "hello"]


@pytest.fixture
def actors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Actor]]:
    made: list[Actor] = []

    def kill(handle: Actor, no_restart: bool = True) -> None:
        handle.killed = True

    fake = types.SimpleNamespace(exceptions=ray.exceptions, kill=kill,
                                 is_initialized=lambda: False)
    monkeypatch.setattr(_ray, "ray_module", lambda: fake)
    monkeypatch.setattr(_ray_cluster, "ray_module", lambda: fake)
    yield made


def supervisor(actors: list[Actor], plan: str, restarts: int = 0) -> RaySupervisor:
    workers = types.SimpleNamespace(num_workers=1, slots=2, zero_copy=True, ray_options=None)
    spec = types.SimpleNamespace(plan=plan, workers=workers)
    sup = RaySupervisor(cast(Any, spec), budget=RestartBudget(restarts))

    def make(spec_ref: Any, worker_id: int, start: ShardPosition | None) -> Actor:
        actors.append(Actor(worker_id, start))
        return actors[-1]

    sup._cls = types.SimpleNamespace(remote=make)
    return sup


async def started(sup: RaySupervisor) -> None:
    sup.workers.append(sup._new(0, None))
    await sup._up(sup.workers[0])
    sup.roster.started(sup.workers[0])


async def until(done: Callable[[], bool]) -> None:
    """Give the loop turns (no time passes) until ``done()``: the supervisor's next step."""
    for _ in range(100):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the supervisor never got there")


def built(seq: int, value: Any, retire: bool = False) -> Built:
    return Built(seq, None, value, 0, 0.5, retire)


async def test_index_batches_recycle_and_a_death_through_the_roster(
        actors: list[Actor]) -> None:
    sup = supervisor(actors, "index", restarts=1)
    await started(sup)
    old = actors[0]
    w = sup.workers[0]
    assert w.phase is Phase.RUNNING and w.link.where == Hello("node", "host", 1000)

    sup.request(0, 0, [1, 2])
    sup.request(0, 1, [3, 4])
    old.asked("fetch")[0][1].answer(built(0, "b0"))
    assert await sup.receive(0) == Delivered("b0", 0, None, 0)
    assert list(w.sent) == [1] and w.batches == 1 and w.busy == 0.5

    # Due for recycling after batch 1: Retiring(None) on the Roster, the successor starts
    # at once, and a task asked now waits for it.
    old.asked("fetch")[1][1].answer(built(1, "b1", retire=True))
    assert await sup.receive(0) == Delivered("b1", 1, None, 0)
    assert w.phase is Phase.HANDED_OVER and sup.budget.recycles == 1 and len(actors) == 2
    sup.request(0, 2, [5])
    assert len(old.asked("fetch")) == 2 and w.sent == {2: [5]}
    new = actors[1]
    assert not new.asked("fetch")

    # Switch: the successor takes its place and the task; the old actor is killed.
    receiving = asyncio.ensure_future(sup.receive(0))
    await until(lambda: bool(new.asked("fetch")))  # the switch sends the task
    assert sup.workers[0] is not w and w.phase is Phase.RETIRED and old.killed
    (args, ref), = new.asked("fetch")
    assert args[1:] == (2, [5])
    ref.answer(built(2, "b2"))
    assert await receiving == Delivered("b2", 2, None, 0)

    # A death: the actor's exit and a death counted; WorkerLost, then a restart.
    sup.request(0, 3, [6])
    new.asked("fetch")[1][1].die()
    with pytest.raises(WorkerLost):
        await sup.receive(0)
    assert sup.workers[0].phase is Phase.LOST and len(sup.budget.deaths) == 1
    await sup.restart(0)
    assert new.killed and sup.workers[0].phase is Phase.RUNNING and sup.budget.restarts == 1
    third = actors[2]
    sup.request(0, 3, [6])
    third.asked("fetch")[0][1].die()  # the budget is spent: the session's failure
    with pytest.raises(WorkerDied, match="is gone"):
        await sup.receive(0)
    with pytest.raises(WorkerDied):
        await sup.receive(0)
    await sup.aclose(0.0)
    assert third.killed


async def test_a_stream_hands_over_at_its_retire_and_its_error_comes_in_turn(
        actors: list[Actor]) -> None:
    sup = supervisor(actors, "stream")
    await started(sup)
    old = actors[0]
    first, second = (ref for _, ref in old.asked("next"))  # ``slots`` calls in flight
    first.answer(built(0, "s0"))
    assert await sup.receive(0) == Delivered("s0", 0, None, 0)
    assert len(old.asked("next")) == 3  # topped up as it was taken
    where = ShardPosition(0, batches=1)
    second.answer(Retire(where))
    receiving = asyncio.ensure_future(sup.receive(0))
    await until(lambda: len(actors) == 2)
    new = actors[1]
    assert new.start == where and sup.budget.recycles == 1
    await until(lambda: len(new.asked("next")) == 2)
    new.asked("next")[0][1].answer(PassOver(0, 1, 0.1))
    assert await receiving == Ended(0)
    assert old.killed and sup.workers[0].link.handle is new
    new.asked("next")[1][1].answer(wire.Failed("KeyError('k')", "Traceback: ...", None))
    with pytest.raises(Exception, match="raised KeyError") as caught:
        await sup.receive(0)
    assert sup.failure is caught.value
    sup.close(0.0)
    with pytest.raises(type(caught.value)):  # the session's failure first, closed or not
        await sup.receive(0)


async def test_a_hung_actor_is_killed_and_its_death_healed(actors: list[Actor]) -> None:
    sup = supervisor(actors, "index", restarts=1)
    await started(sup)
    sup.request(0, 0, [1])
    receiving = asyncio.ensure_future(sup.receive(0))
    await until(lambda: sup._awaited == 0)
    w = sup.workers[0]
    w.heard -= 10.0  # silent for 10 s, as the consumer waited
    assert sup.heal(5.0) and actors[0].killed and w.silenced is not None
    assert sup.heal(5.0)  # killed already: its death is on its way
    actors[0].asked("fetch")[0][1].die()
    with pytest.raises(WorkerLost):
        await receiving
    assert sup.budget.deaths[0].kind == "hang"
    sup.close(0.0)
    with pytest.raises(LoaderClosedError):
        await sup.receive(0)


async def rewinding(actors: list[Actor]) -> tuple[RaySupervisor, Actor, list[Ref]]:
    """A stream's actor, asked to rewind to pass 3 with its first two calls in flight."""
    sup = supervisor(actors, "stream")
    await started(sup)
    calls = [ref for _, ref in actors[0].asked("next")]
    sup.rewind(0, 3)
    return sup, actors[0], calls


async def test_a_streams_failed_batch_and_its_rewind_are_the_roster_events_of_a_process(
        actors: list[Actor]) -> None:
    # issue 32 on Ray: a failed batch is raised in its turn and the stream goes on; a
    # rewind is a call in turn after those in flight (their replies are the pass dropped),
    # answered Rewound as a process worker answers its Rewind
    sup, actor, (first, second) = await rewinding(actors)
    assert actor.numbered() == [("next", 0), ("next", 1), ("rewind", 2)]
    assert actor.asked("rewind")[0][0] == (2, 3)
    first.answer(built(0, "dropped"))
    second.answer(wire.BatchFailed(1, "ValueError('bad')", "Traceback: ...", None, None,
                                   [0, 1]))
    actor.asked("rewind")[0][1].answer(wire.Rewound(3))
    assert await sup.receive(0) == Delivered("dropped", 0, None, 0)
    with pytest.raises(BatchFailure) as failed:
        await sup.receive(0)
    assert "raised ValueError('bad')" in str(failed.value.error)
    assert failed.value.mark == [0, 1] and sup.failure is None  # the session goes on
    assert await sup.receive(0) == Rewound(3)
    assert sup.workers[0].rewinding is None
    assert actor.numbered()[3:] == [("next", 3), ("next", 4)]  # pass 3's, topped up
    sup.close(0.0)


async def test_a_rewind_is_the_first_call_of_a_retiring_actors_successor(
        actors: list[Actor]) -> None:
    # it retired in the pass dropped before it reached the rewind: its successor is asked
    # the rewind before any batch, so that it cannot retire in that pass too (with
    # max_batches_per_worker=1 every successor would, for ever)
    sup, old, (first, _) = await rewinding(actors)
    first.answer(Retire(ShardPosition(0, batches=1)))
    receiving = asyncio.ensure_future(sup.receive(0))
    await until(lambda: len(actors) == 2)
    new = actors[1]
    assert new.numbered() == [("rewind", 0), ("next", 1)]  # then pass 3's calls
    assert new.asked("rewind")[0][0] == (0, 3)
    new.asked("rewind")[0][1].answer(wire.Rewound(3))
    assert await receiving == Rewound(3)
    assert sup.workers[0].link.handle is new and old.killed
    assert new.numbered() == [("rewind", 0), ("next", 1), ("next", 2)]
    sup.close(0.0)
