"""Workers on a Ray cluster (``worker_type="ray"``): the Roster's transport over actors.

Each worker is an actor (aioloader/workers/_ray_actor.py), pulled: ``fetch(seq, indices)``
for an index batch, up to ``slots`` ``next()`` calls in flight for a stream, ``rewind`` for a
stream left early. Each reply becomes the Roster event a process worker's message is, and
Ray's error on a call is the actor's exit (docs/architecture.md, "One Roster"). A batch
reaches this process through the object store, its tensors views of the object's buffer
(copied out with ``zero_copy=False``); awaiting an ``ObjectRef`` never blocks the loop.
Closing kills every actor and drops every reference, so nothing of the loader stays in the
object store. Imports Ray only when a supervisor starts: ``import aioloader`` never needs it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._errors import SourcePicklingError, WorkerDied, WorkerError
from .._stats import ArenaStats, WorkerStats
from ..pipeline._loads import SkipLog, SkippedLoad
from ..plane import _wire as wire
from ..plans._position import ShardPosition
from ._phases import Phase, RestartBudget, WorkerState
from ._ray_actor import Hello, PassOver, RayWorker, Reply, Retire
from ._ray_cluster import (
    connect,
    first_reply,
    looked_up,
    ray_module,
    wait_and_drop,
)
from ._spec import WorkerSpec
from ._supervising import Supervising, told_error, worker_stats

log = logging.getLogger("aioloader")

PLACEMENT_PATIENCE = 30.0  # seconds an actor may take to start before a warning says why
CLOSE_WAIT = 10.0  # seconds a close waits for Ray to confirm that its actors are dead


@dataclass(eq=False)
class ActorLink:
    """The parent's end of one worker's actor: its calls in flight, in order, and the
    batches read and not yet taken (by the number the Roster's ``wire.Batch`` carries)."""

    handle: Any
    hello: Any  # the ObjectRef of its Hello, until it is known
    calls: collections.deque[Any] = field(default_factory=collections.deque)  # ObjectRefs
    numbers: Iterator[int] = field(default_factory=itertools.count)  # calls, served in order
    read: int = 0  # replies read
    values: dict[int, Any] = field(default_factory=dict)
    where: Hello | None = None

    def actor(self) -> str:
        """'Ray actor 1a2b3c on node 4d5e6f (host)': where this worker runs."""
        actor = self.handle._actor_id.hex()[:12]
        if self.where is None:
            return f"Ray actor {actor}"
        return f"Ray actor {actor} on node {self.where.node[:12]} ({self.where.host})"

    @property
    def pid(self) -> int | None:
        return self.where.pid if self.where is not None else None


Actor = WorkerState[ActorLink]

# Phases in which an actor is asked for more: before its hand-over (its calls in flight
# then are its own; after it, its successor's).
_ASKED = frozenset({Phase.STARTING, Phase.RUNNING})


class RaySupervisor(Supervising[ActorLink]):
    """``spec.workers.num_workers`` Ray actors for ``spec``, on the Roster that process
    workers use (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, *, budget: RestartBudget | None = None,
                 skips: SkipLog | None = None) -> None:
        super().__init__(spec, budget, skips)
        self._stream = spec.plan != "index"
        self._slots = spec.workers.slots
        self._spec_ref: Any = None  # the spec, put once in the object store for every actor
        self._cls: Any = None
        self._retired: list[Actor] = []  # replaced actors: killed, confirmed at close

    # ------------------------------------------------------------------ start

    def _options(self) -> dict[str, Any]:
        given = dict(self.spec.workers.ray_options or {})
        given.setdefault("num_cpus", 1)
        # Calls wait for their turn in the actor: as many may be in flight as a window holds.
        return {**given, "max_restarts": 0, "max_task_retries": 0,
                "max_concurrency": max(64, 4 * self.num_workers * self._slots)}

    async def _prepare(self) -> None:
        """Connect to Ray (``ray.init()`` unless the caller did) and put the spec in the
        object store once; each actor's start then waits until it says where it runs."""
        ray = ray_module()
        await connect()
        try:
            self._spec_ref = ray.put(self.spec)
        except Exception as exc:
            raise SourcePicklingError(
                f"the worker spec (source {type(self.spec.source).__name__}) cannot be "
                f"sent to Ray actors: {exc!r}. Make the source, collate_fn and "
                "worker_init_fn picklable with cloudpickle") from exc
        self._cls = ray.remote(RayWorker).options(**self._options())

    def _new(self, worker_id: int, start: ShardPosition | None, *,
             ahead: bool = True) -> Actor:
        handle = self._cls.remote(self._spec_ref, worker_id, start)
        w = WorkerState(worker_id, ActorLink(handle, handle.hello.remote()))
        if ahead:  # a stream's first batches are built while the others start
            self._top_up(w)
        return w

    async def _up(self, w: Actor) -> None:
        """Wait until ``w`` says where it runs (its start). Its death before that is a
        death like a later one, for the Roster to count; its creation task raising (the
        spec did not load there) is the session's failure, which no restart heals."""
        ray = ray_module()
        # Ray's own future of the ref, not ensure_future(ref), and its error read, never
        # raised here: the coroutine's frame, in the error's traceback, held the ObjectRef
        # in a cycle, so the dead actor's reply stayed owned after close until a gc (issue
        # 22 audit).
        hello: asyncio.Future[Hello] = asyncio.wrap_future(w.link.hello.future())
        w.link.hello = None
        try:
            # Ray waits without a word to us: say why, after 30 s, 90 s, 210 s...
            began, patience = time.monotonic(), PLACEMENT_PATIENCE
            while not (await asyncio.wait({hello}, timeout=patience))[0]:
                await self._say_why_not_running(w, time.monotonic() - began)
                patience *= 2
        finally:
            hello.cancel()  # (cancelled while waiting: nobody will read it)
        error = hello.exception()
        if error is None:
            w.link.where = hello.result()
            w.born = self.last_heard = time.monotonic()
            return
        del hello
        if not isinstance(error, ray.exceptions.RayError):
            raise error
        dead = isinstance(error, ray.exceptions.ObjectLostError) or (
            isinstance(error, ray.exceptions.RayActorError) and not error.actor_init_failed)
        if not dead:
            raise self._died(w, error) from error
        # Killed before it said where it ran (in worker_init_fn, say): the budget decides,
        # as for any death (issue 22 audit). Ray's actor table names its node and pid.
        w.link.where = await looked_up(w.link.handle)  # (None before: it never said)
        self._exited(w, error)
        if self.failure is not None:
            raise self.failure from error

    async def _say_why_not_running(self, w: Actor, waited: float) -> None:
        """Warn that ``w`` has not started after ``waited`` seconds, and why: Ray has no node
        with what it asks for free, or it has placed it and its process is still starting
        (on a busy 2-core machine, actors importing torch took over 30 s)."""
        where = await looked_up(w.link.handle)
        why = (f"Ray has no node with what it asks for free yet ({self._options()})"
               if where is None else
               f"Ray placed it on node {where.node} ({where.host}, pid {where.pid}), where "
               "its process is still starting (importing the source's modules, its "
               "worker_init_fn, or a busy machine)")
        log.warning("%s is not running after %.0f s: %s; see `ray status`", self._named(w),
                    waited, why)

    def _top_up(self, w: Actor) -> None:
        """A stream: keep ``slots`` calls in flight, each a batch once it is built (none
        once it retires: what it owes is its successor's)."""
        if not self._stream or self.closed or w.phase not in _ASKED:
            return
        while len(w.link.calls) < self._slots:
            w.link.calls.append(w.link.handle.next.remote(next(w.link.numbers)))

    # ------------------------------------------------------------------ the Roster's events

    def _ask(self, w: Actor, seq: int, indices: list[int]) -> None:
        w.link.calls.append(w.link.handle.fetch.remote(next(w.link.numbers), seq, indices))

    def _rewind(self, w: Actor, pass_no: int) -> None:
        """A call of its own after the calls in flight (whose replies the consumer drops),
        then the stream's calls again; a handed-over actor is asked nothing (its successor
        answers, ``Roster.rewind``)."""
        if self.closed or w.phase not in _ASKED:
            return
        w.link.calls.append(w.link.handle.rewind.remote(next(w.link.numbers), pass_no))
        self._top_up(w)

    async def _wait(self, worker_id: int) -> None:
        w = self.workers[worker_id]
        if not w.link.calls:
            self._top_up(w)
            assert w.link.calls, f"receive() from worker {worker_id} with nothing requested"
        await self._read(w)

    async def _read(self, w: Actor) -> None:
        """Await ``w``'s first call in flight and put its reply to the Roster: a batch, a
        pass end, a hand-over, the worker's error, or Ray's error (a death)."""
        ray = ray_module()
        reply = await first_reply(w.link.calls)
        w.heard = self.last_heard = time.monotonic()
        if self.closed:
            return  # (the calls went with the close)
        if isinstance(reply, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
            self._exited(w, reply)
        elif isinstance(reply, BaseException):
            err = WorkerError(f"{self._named(w)}: Ray failed to deliver its batch: {reply}",
                              worker_id=w.id, pid=w.link.pid)
            err.__cause__ = reply
            self.roster.fail(err)
        else:
            w.link.calls.popleft()
            self._heard(w, reply)
            self._top_up(w)

    def _heard(self, w: Actor, reply: Reply) -> None:
        """``w``'s ``reply``, as the Roster's message."""
        for s in getattr(reply, "skipped", ()):
            self.skips.add(SkippedLoad(s.key, w.id, s.attempts, s.error))
        if isinstance(reply, (wire.Failed, wire.BatchFailed)):  # (a stream's batch: it goes on)
            self.roster.on_message(w, told_error(self._named(w), reply, worker_id=w.id,
                                                 pid=w.link.pid))
            return
        if isinstance(reply, wire.Rewound):
            self.roster.on_message(w, reply)
            return
        if isinstance(reply, Retire):  # a stream's hand-over: later calls are the successor's
            w.link.calls.clear()
            self._retiring(w, reply.position.to_data())
            return
        key = w.link.read
        w.link.read += 1
        if isinstance(reply, PassOver):
            w.busy = reply.busy
            self.roster.on_message(w, wire.PassEnd(key, reply.pass_no, reply.batches))
            return
        w.link.values[key] = reply.value
        self.roster.on_message(w, wire.Batch(key, reply.seq, reply.nbytes, None, reply.mark,
                                             reply.busy))
        if reply.retire:  # index batches: the tasks not yet answered go to the next one
            self._retiring(w, None)

    def _retiring(self, w: Actor, position: Any) -> None:
        action = self.roster.on_message(w, wire.Retiring(position))
        if action is not None:
            self._start_successor(action)

    def _exited(self, w: Actor, error: BaseException) -> None:
        """``w``'s actor is gone (or its batch went with its node): its exit, and the death
        the Roster counts (lost within the budget, else the session's failure)."""
        w.link.calls.clear()
        if self.roster.on_exit(w):
            self.roster.on_death(w, self._died(w, error))
        self._fail_cause(error)

    async def _take(self, w: Actor, msg: wire.Batch, lease: bool) -> Any:
        """Tensors stay views of the object store (zero-copy), or are copied out
        (``zero_copy=False``, a cache)."""
        value = w.link.values.pop(msg.slot)
        return value if lease and self.spec.workers.zero_copy else copy.deepcopy(value)

    async def _switch(self, worker_id: int) -> None:
        """Recycling: what the retiring actor was asked before its hand-over comes first;
        then its successor takes its place (:meth:`Supervising._switch`)."""
        old = self.workers[worker_id]
        if not old.link.calls:
            await super()._switch(worker_id)
            return
        await self._awaiting(worker_id, self._read(old))

    def _askable(self, w: Actor) -> bool:
        return w.phase in _ASKED

    def _took_over(self, new: Actor) -> None:
        self._top_up(new)

    # ------------------------------------------------------------------ faults

    def _named(self, w: Actor) -> str:
        pid = f", pid {w.link.pid}" if w.link.where is not None else ""
        return f"worker {w.id} ({w.link.actor()}{pid})"

    def _died(self, w: Actor, exc: BaseException) -> WorkerDied:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return WorkerDied(w.id, w.link.pid, None,
                          f"its {w.link.actor()} is gone ({type(exc).__name__}: {first})",
                          hung=w.silenced)

    def _kill(self, w: Actor, silence: float) -> bool:
        """``ray.kill``: its death is then healed like any other. An actor says nothing
        while it builds a batch, so a batch that takes longer than ``timeout`` counts as a
        hang here."""
        log.warning("%s hung: no reply for %.1f s (timeout=%s) while the consumer waited "
                    "for its batch; killing its actor to replace it", self._named(w),
                    w.silenced, silence)
        ray_module().kill(w.link.handle, no_restart=True)
        return True

    def _let_go(self, gone: list[Actor]) -> None:
        """Kill the actors of ``gone`` and drop their calls; a close confirms their deaths."""
        for w in gone:
            w.link.calls.clear()  # its calls and batches leave the object store with the
            w.link.values.clear()  # last reference
            with contextlib.suppress(Exception):
                ray_module().kill(w.link.handle, no_restart=True)
            self._retired.append(w)

    # ------------------------------------------------------------------ watch, report

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        """Each worker's telemetry (its node too); no arena: batches go through Ray."""
        workers = tuple(
            worker_stats(w, w.link.pid, w.link.where.node if w.link.where else None)
            for w in list(self.workers))
        in_flight = sum(len(w.link.calls) for w in self.workers)
        slots = self._slots * len(self.workers)
        return workers, ArenaStats(slots, max(slots - in_flight, 0), in_flight, 0, 0)

    # ------------------------------------------------------------------ stop

    def _begin_close(self) -> list[Any]:
        """Kill every actor and drop every reference; one call per killed actor, which Ray
        fails once the actor is dead for sure."""
        everyone = self.roster.close()
        if everyone is None:
            return []
        self._let_go(everyone)
        gone, self._retired = self._retired, []
        for w in gone:
            w.link.hello = None
        self._spec_ref = None
        with contextlib.suppress(Exception):  # (Ray shut down: nothing left to confirm)
            if ray_module().is_initialized():
                return [w.link.handle.hello.remote() for w in gone]
        return []

    async def aclose(self, grace: float) -> None:
        """Kill every actor and wait (without blocking the loop) until Ray says they are
        dead, so that no actor and no batch outlives the close."""
        probes = self._begin_close()
        if probes:  # (waited for in a thread, and dropped there: see wait_and_drop)
            await asyncio.to_thread(wait_and_drop, probes, CLOSE_WAIT + grace)

    def close(self, grace: float) -> None:
        """Blocking version of :meth:`aclose`."""
        wait_and_drop(self._begin_close(), CLOSE_WAIT + grace)
