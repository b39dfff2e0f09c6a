"""What every supervisor does around its :class:`~aioloader.workers._phases.Roster`, whatever
carries its workers.

A process worker (or a thread) talks over a socket and an arena
(aioloader/workers/_supervisor.py), a Ray worker over an actor's calls (aioloader/workers/_ray.py);
both put what a worker says into the same Roster events (a batch, a pass end, a hand-over,
an error, an exit) and act on the same answers. So the consumer's side is written once
here: :meth:`Supervising.receive` runs the Roster's actions, :meth:`Supervising.heal` kills a
hung worker, :meth:`Supervising.restart` replaces a lost one. A transport says only how to
take a batch, wait for the next event, start, switch, kill and let go of a worker.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from .._errors import BatchFailure, WorkerError, worker_error_for
from .._stats import ArenaStats, WorkerStats
from ..pipeline._loads import SkipLog
from ..plane import _wire as wire
from ..plans._position import ShardPosition
from ._phases import (
    ALIVE,
    Deliver,
    EndPass,
    EndRewind,
    Phase,
    Raise,
    RestartBudget,
    Roster,
    StartSuccessor,
    Switch,
    WorkerState,
)
from ._spec import WorkerSpec

log = logging.getLogger("aioloader")

L = TypeVar("L")


@dataclass(frozen=True, slots=True)
class Received:
    """A batch (or a chunk of instances) taken from a worker, the consumer's own; ``seq`` and
    ``mark`` (where a stream's batch lies in its pass) as the worker sent them."""

    value: Any
    seq: int
    mark: Any
    nbytes: int  # tensor bytes (telemetry)


@dataclass(frozen=True, slots=True)
class Ended:
    """The worker finished pass ``pass_no`` of its shard."""

    pass_no: int


@dataclass(frozen=True, slots=True)
class Rewound:
    """The worker dropped its pass: what it sends next is pass ``pass_no``, from its start."""

    pass_no: int


Arrival = Received | Ended | Rewound


class Supervising(Generic[L]):
    """A session's workers on one Roster; ``L``: what links the parent to one worker."""

    def __init__(self, spec: WorkerSpec, num_workers: int, budget: RestartBudget | None,
                 skips: SkipLog | None) -> None:
        self.spec = spec
        self.num_workers = num_workers
        self.budget = budget if budget is not None else RestartBudget()
        self.roster: Roster[L] = Roster(self.budget)
        self.skips = skips if skips is not None else SkipLog()  # on_error="skip"
        self.last_heard = time.monotonic()  # any word from any worker: the timeout's clock
        self._awaited: int | None = None  # the worker the consumer waits for in receive()
        self._restarting = False  # a replacement's start is awaited: that is no silence

    @property
    def workers(self) -> list[WorkerState[L]]:
        return self.roster.workers

    @property
    def failure(self) -> BaseException | None:
        return self.roster.failure

    @property
    def closed(self) -> bool:
        return self.roster.closed

    # ------------------------------------------------------------------ the transport's

    async def _prepare(self) -> None:
        """Before the first worker starts: what every worker's start needs."""

    def _first(self, worker_id: int) -> WorkerState[L]:
        """Worker ``worker_id`` of the first start, registered and submitted."""
        return self._new(worker_id, None)

    def _new(self, worker_id: int, start: ShardPosition | None, *,
             ahead: bool = True) -> WorkerState[L]:
        """Worker ``worker_id`` registered and its start submitted; a stream's goes on
        from ``start`` (None: where the spec says). ``ahead``: a transport that asks a
        stream for its batches (Ray's calls) may ask at once; False when the worker's
        first request must be a rewind (:meth:`_start_successor`)."""
        raise NotImplementedError

    async def _up(self, w: WorkerState[L]) -> None:
        """Wait until ``w``'s start is done (a death meanwhile goes to the Roster)."""
        raise NotImplementedError

    def _let_go(self, gone: list[WorkerState[L]]) -> None:
        """Close the links of ``gone`` (retired by the Roster): they stop, and are reaped."""
        raise NotImplementedError

    def _watch_new(self, w: WorkerState[L]) -> None:
        """``w`` replaced a worker in place: watch it as the others are watched."""

    def _ask(self, w: WorkerState[L], seq: int, indices: list[int]) -> None:
        """Send ``w`` the task of batch ``seq``: ``indices``."""
        raise NotImplementedError

    def _rewind(self, w: WorkerState[L], pass_no: int) -> None:
        """Ask ``w`` to drop its pass and stream pass ``pass_no`` from its start."""
        raise NotImplementedError

    def _took_over(self, new: WorkerState[L]) -> None:
        """``new`` took its retired predecessor's place (:meth:`_switch`): it gets the
        tasks that one did not answer, and is watched."""
        raise NotImplementedError

    async def _take(self, w: WorkerState[L], msg: wire.Batch, lease: bool) -> Any:
        """Batch ``msg``'s value, the consumer's own."""
        raise NotImplementedError

    def _slot_read(self, w: WorkerState[L], slot: int) -> None:
        """A message of ``w``'s that held ``slot`` and no batch (a pass end, a stream's
        failed batch) is handed over: the slot may go back."""

    async def _wait(self, worker_id: int) -> None:
        """Wait for the next event of worker ``worker_id`` (or of the session)."""
        raise NotImplementedError

    def _starved(self, w: WorkerState[L]) -> float:
        """Seconds of ``w``'s silence that show no hang: runnable but not run since the
        consumer began to wait for it (and then the unmeasured time before, too); 0.0
        where a transport cannot tell."""
        return 0.0

    def _can_kill(self) -> bool:
        """Whether a hung worker can be killed at all (a thread cannot)."""
        return True

    def _kill(self, w: WorkerState[L], silence: float) -> bool:
        """Kill ``w``, hung (:meth:`heal`): False where it cannot be."""
        raise NotImplementedError

    def _named(self, w: WorkerState[L]) -> str:
        """'worker 2 (pid 123)': ``w`` in a message."""
        raise NotImplementedError

    def attach(self) -> None:
        """Watch the workers on the running loop, while an epoch runs (Ray: nothing to
        watch, an awaited ObjectRef wakes whichever loop awaits it)."""

    def detach(self) -> None:
        """Stop watching them: the epoch is over (the workers may stay for the next)."""

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        """Each worker's telemetry, and the arenas'; plain reads."""
        raise NotImplementedError

    async def aclose(self, grace: float) -> None:
        """Stop every worker and wait for it, without blocking the loop."""
        raise NotImplementedError

    def close(self, grace: float) -> None:
        """Blocking version of :meth:`aclose`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ start, ask, fail

    async def start(self) -> None:
        """Start every worker; cancellation-safe: whatever fails or is cancelled, the
        workers registered so far are stopped (no grace). Each worker is registered before
        its start is submitted, so closing always sees every one."""
        try:
            await self._prepare()
            for k in range(self.num_workers):
                self.workers.append(self._first(k))
            for w in self.workers:
                await self._up(w)
                self.roster.started(w)
        except BaseException:
            await self.aclose(0.0)
            raise

    def request(self, worker_id: int, seq: int, indices: list[int]) -> None:
        """Ask worker ``worker_id`` for the batch of ``indices``, numbered ``seq`` (the
        producer bounds how many are in flight). Once it is handed over the task waits for
        its successor, which gets every task the retiring one did not answer, in order,
        when it takes over."""
        if self.roster.request(worker_id, seq, indices) and not self.closed:
            self._ask(self.workers[worker_id], seq, indices)

    def rewind(self, worker_id: int, pass_no: int) -> None:
        """Ask worker ``worker_id``'s stream for pass ``pass_no`` from its start: it says so
        (:class:`Rewound`, from :meth:`receive`) after what it sent before, which the
        consumer drops; if it retires first, its successor says so."""
        for w in self.roster.rewind(worker_id, pass_no):
            if not self.closed:
                self._rewind(w, pass_no)

    def _fail_cause(self, exc: BaseException) -> None:
        """``exc`` is why the session failed, unless its failure has a cause already."""
        if self.failure is not None and self.failure.__cause__ is None:
            self.failure.__cause__ = exc

    def describe(self, worker_ids: list[int]) -> str:
        """The workers ``worker_ids``, for a timeout's message."""
        return ", ".join(self._named(self.workers[k]) for k in worker_ids)

    # ------------------------------------------------------------------ the consumer's

    def _start_successor(self, action: StartSuccessor) -> None:
        w = self.workers[action.worker_id]
        start = (ShardPosition.from_data(action.position) if action.position is not None
                 else None)  # a stream: the successor goes on from there
        new = self._new(w.id, start, ahead=w.rewinding is None)
        self.roster.add_successor(w, new)
        if new.rewinding is not None:  # it starts in the pass dropped: asked first
            self._rewind(new, new.rewinding)
        log.info("%s is retiring (recycle %d); its successor starts", self._named(w),
                 self.budget.recycles)

    async def _switch(self, worker_id: int) -> None:
        """Recycling (:class:`Switch`): worker ``worker_id``'s successor, once up, takes its
        place and the tasks it did not answer; then the next hand-over that waited."""
        old = self.workers[worker_id]
        new = old.successor
        assert new is not None
        await self._up(new)
        then = self.roster.switched(worker_id)
        if self.closed:
            return  # closing covered both (the successor was still the old one's)
        self._let_go([old])
        self._took_over(new)
        if then is not None:  # the next hand-over that waited for this one
            self._start_successor(then)

    async def receive(self, worker_id: int, *, lease: bool = True) -> Arrival:
        """The next batch or pass end of worker ``worker_id``, in the order it sent them.

        Raises the session's first failure, or :class:`LoaderClosedError` once closed.
        A worker's own exception waits in its turn: it is raised (and becomes the session's
        failure) when it is that worker's turn, so earlier batches come first. A worker that
        died is :class:`~aioloader.workers._phases.WorkerLost` once what it sent before is
        taken.
        """
        while True:
            action = self.roster.next_step(worker_id)
            w = self.workers[worker_id]
            if isinstance(action, Raise):
                if isinstance(action.error, BatchFailure) and action.error.slot is not None:
                    self._slot_read(w, action.error.slot)
                raise action.error
            if isinstance(action, EndPass):
                self._slot_read(w, action.msg.slot)
                return Ended(action.msg.pass_no)
            if isinstance(action, EndRewind):
                return Rewound(action.msg.pass_no)
            if isinstance(action, Deliver):
                msg = action.msg
                value = await self._take(w, msg, lease)
                w.took(msg)
                return Received(value, msg.seq, msg.mark, msg.nbytes)
            if isinstance(action, StartSuccessor):
                self._start_successor(action)
            elif isinstance(action, Switch):
                await self._switch(worker_id)
            else:
                await self._awaiting(worker_id, self._wait(worker_id))

    async def _awaiting(self, worker_id: int, wait: Awaitable[None]) -> None:
        """``wait``, with ``worker_id`` the worker the consumer is known to wait for
        meanwhile (the one :meth:`heal` judges)."""
        self._awaited = worker_id
        try:
            await wait
        finally:
            self._awaited = None

    def heal(self, silence: float) -> bool:
        """Nothing was heard for ``silence`` seconds (the loader's ``timeout``) while the
        consumer waited: kill the worker it waits for if that one hung (a deadlock in user
        code, a read that never returns, SIGSTOP) and a restart can replace it; its death
        then takes a crash's path (its work is built again, exactly once, in order).
        A worker that spent part of that silence runnable but not run (``_starved``: a
        loaded machine) is slow, not hung: only the rest counts. True: healing, keep
        waiting."""
        if self._restarting:
            return True
        if self._awaited is not None and self.workers[self._awaited].phase is Phase.LOST:
            return True  # died within the budget: the consumer, woken, restarts it next
        if self._awaited is None or not self._can_kill():
            return False
        awaited = self.workers[self._awaited]
        if awaited.silenced is not None and awaited.phase in ALIVE:
            return True  # killed already: its death is on its way (a loaded machine)
        starved = self._starved(awaited)
        if self.budget.room and time.monotonic() - awaited.heard - starved < silence:
            log.debug("worker %d is silent but waited %.1f s for a CPU: not hung",
                      awaited.id, starved)
            return True
        w = self.roster.hung(self._awaited, silence, time.monotonic())
        return w is not None and self._kill(w, silence)

    async def restart(self, worker_id: int, start: ShardPosition | None = None) -> None:
        """Replace worker ``worker_id``, which died
        (:class:`~aioloader.workers._phases.WorkerLost`), by a new one with the same shard
        and seeds; a stream's starts at ``start``. Index batches in flight are asked again
        by the producer."""
        new = self._new(worker_id, start)
        died, gone = self.roster.restart(worker_id, new)
        self._let_go(gone)
        log.warning("%s (a %s); restarting it (restart %d of max_worker_restarts=%d)%s",
                    died, died.kind, len(self.budget.deaths), self.budget.limit,
                    f", from pass {start.pass_no} block {start.start.block}"
                    if start is not None else "")
        self._restarting = True
        try:
            await self._up(new)
        finally:
            self._restarting = False
        if self.closed:
            return  # closed meanwhile: reaping covers it
        self.roster.started(new)
        self.last_heard = time.monotonic()  # the replacement is up: a sign of life
        self._watch_new(new)


def worker_stats(w: WorkerState[Any], pid: int | None, node: str | None = None) -> WorkerStats:
    """Worker ``w``'s telemetry: its batches, their rate and its busy share."""
    alive = max(w.last - w.born, 1e-9)
    return WorkerStats(w.id, pid, w.batches, w.batches / alive if w.batches else 0.0,
                       min(w.busy / alive, 1.0) if w.batches else 0.0, node=node)


def rebuilt_error(who: str, told: wire.Failed | wire.BatchFailed, original: object = None, *,
                  worker_id: int, pid: int | None) -> WorkerError:
    """A worker's exception as the consumer sees it: a WorkerError that is also of the
    original's type where possible (``except KeyError:`` still works, as with torch), the
    worker's traceback in its message, the original as its cause: ``original`` (a thread
    worker's, by reference), or ``told``'s pickle when it unpickles here."""
    if original is None and told.pickled is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(told.pickled)
    err = worker_error_for(
        original if isinstance(original, BaseException) else None,
        f"{who} raised {told.error_repr}\n\n  Traceback from the worker:\n  "
        + told.traceback.rstrip().replace("\n", "\n  "), worker_id=worker_id, pid=pid)
    if isinstance(original, BaseException):
        err.__cause__ = original
    return err


@overload
def told_error(who: str, told: wire.Failed, original: object = None, *, worker_id: int,
               pid: int | None) -> WorkerError: ...
@overload
def told_error(who: str, told: wire.BatchFailed, original: object = None, *, worker_id: int,
               pid: int | None) -> BatchFailure: ...
def told_error(who: str, told: wire.Failed | wire.BatchFailed, original: object = None, *,
               worker_id: int, pid: int | None) -> WorkerError | BatchFailure:
    """What a worker's :class:`~aioloader.plane._wire.Failed` is on the Roster, its
    :func:`rebuilt_error`; one batch's error (``BatchFailed``, the worker went on) comes
    as that batch's :class:`BatchFailure`, with where it lies in its pass and its slot."""
    err = rebuilt_error(who, told, original, worker_id=worker_id, pid=pid)
    if isinstance(told, wire.BatchFailed):
        return BatchFailure(told.seq, err, told.mark, told.slot)
    return err
