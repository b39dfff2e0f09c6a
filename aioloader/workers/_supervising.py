"""The consumer's side of every supervisor, around its Roster: receive, heal, restart.

A transport (processes, threads, Ray actors) says only how to start, ask, wait for, take
from, switch, kill and let go of a worker."""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._errors import BatchFailure, WorkerError, worker_error_for
from .._stats import ArenaStats, WorkerStats
from ..pipeline._loads import SkipLog
from ..plane import _wire as wire
from ..plans._position import ShardPosition
from ._phases import (
    ALIVE,
    Phase,
    RestartBudget,
    Roster,
    StartSuccessor,
    Switch,
    WorkerState,
)
from ._spec import WorkerSpec
from ._steps import Delivered

log = logging.getLogger("aioloader")

L = TypeVar("L")


@dataclass(frozen=True, slots=True)
class Ended:
    """The worker finished pass ``pass_no`` of its shard."""

    pass_no: int


@dataclass(frozen=True, slots=True)
class Rewound:
    """The worker dropped its pass: pass ``pass_no`` follows, from its start."""

    pass_no: int


Arrival = Delivered | Ended | Rewound


class Supervising(Generic[L]):
    """A session's workers on one Roster; ``L``: what links the parent to one worker."""

    def __init__(self, spec: WorkerSpec, budget: RestartBudget | None,
                 skips: SkipLog | None) -> None:
        self.spec = spec
        self.num_workers = spec.workers.num_workers
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

    def _new(self, worker_id: int, start: ShardPosition | None, *,
             ahead: bool = True) -> WorkerState[L]:
        """Worker ``worker_id`` registered and its start submitted, a stream's from
        ``start`` (None: the spec's). ``ahead=False``: its first request must be a rewind,
        so a transport that asks a stream for batches (Ray) must not ask yet."""
        raise NotImplementedError

    # Each transport's own (the methods of its class):
    _up: Callable[[WorkerState[L]], Awaitable[None]]  # until a start is done (or a death)
    _let_go: Callable[[list[WorkerState[L]]], None]  # workers the Roster retired
    _ask: Callable[[WorkerState[L], int, list[int]], None]  # batch seq's indices
    _rewind: Callable[[WorkerState[L], int], None]  # a stream's pass from its start
    _took_over: Callable[[WorkerState[L]], None]  # a successor is in its place, and asked
    _take: Callable[[WorkerState[L], wire.Batch, bool], Awaitable[Any]]  # a batch's value
    _wait: Callable[[int], Awaitable[None]]  # the next event of worker k, or the session's
    _kill: Callable[[WorkerState[L], float], bool]  # a hung one; False: it cannot be
    _named: Callable[[WorkerState[L]], str]  # 'worker 2 (pid 123)'
    stats: Callable[[], tuple[tuple[WorkerStats, ...], ArenaStats]]  # plain reads
    aclose: Callable[[float], Awaitable[None]]  # stop every worker, given a grace in seconds
    close: Callable[[float], None]  # the same, blocking

    def _watch_new(self, w: WorkerState[L]) -> None:
        pass

    def _slot_read(self, w: WorkerState[L], slot: int) -> None:
        """A message of ``w``'s that held ``slot`` and no batch is handed over."""

    def _starved(self, w: WorkerState[L]) -> float:
        """Seconds of ``w``'s silence spent runnable but not run (no hang); 0.0: unknown."""
        return 0.0

    def _can_kill(self) -> bool:
        return True

    def _askable(self, w: WorkerState[L]) -> bool:
        """Whether ``w``, in its predecessor's place, is asked for the tasks that one did
        not answer (a Ray actor only while it starts or runs)."""
        return True

    def attach(self) -> None:
        """Watch the workers on the running loop while an epoch runs (Ray: nothing to watch)."""

    def detach(self) -> None:
        pass


    # ------------------------------------------------------------------ start, ask, fail

    async def start(self) -> None:
        """Start every worker, each registered first: a failed start stops them all."""
        try:
            await self._prepare()
            for k in range(self.num_workers):
                self.workers.append(self._new(k, None))
            for w in self.workers:
                await self._up(w)
                self.roster.started(w)
        except BaseException:
            await self.aclose(0.0)
            raise

    def request(self, worker_id: int, seq: int, indices: list[int]) -> None:
        """Ask worker ``worker_id`` for batch ``seq`` (or its successor, once handed over)."""
        if self.roster.request(worker_id, seq, indices) and not self.closed:
            self._ask(self.workers[worker_id], seq, indices)

    def rewind(self, worker_id: int, pass_no: int) -> None:
        """Ask worker ``worker_id``'s stream for pass ``pass_no`` again (:class:`Rewound`)."""
        for w in self.roster.rewind(worker_id, pass_no):
            if not self.closed:
                self._rewind(w, pass_no)

    def _fail_cause(self, exc: BaseException) -> None:
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
        """Recycling: worker ``worker_id``'s successor, once up, takes its place."""
        old = self.workers[worker_id]
        new = old.successor
        assert new is not None
        await self._up(new)
        then = self.roster.switched(worker_id)
        if self.closed:
            return  # closing covered both (the successor was still the old one's)
        self._let_go([old])
        if self._askable(new):
            for seq, indices in new.sent.items():  # what the retiring one did not answer
                self._ask(new, seq, indices)
        self._took_over(new)
        if then is not None:  # the next hand-over that waited for this one
            self._start_successor(then)

    async def receive(self, worker_id: int, *, lease: bool = True) -> Arrival:
        """The next batch or pass end of worker ``worker_id``, in the order it sent them.
        Raises the session's failure, :class:`LoaderClosedError`, a worker's own exception in
        its turn, and :class:`~aioloader.workers._phases.WorkerLost` for a death healed."""
        while True:
            action = self.roster.next_step(worker_id)
            w = self.workers[worker_id]
            if isinstance(action, BaseException):
                if isinstance(action, BatchFailure) and action.slot is not None:
                    self._slot_read(w, action.slot)
                raise action
            if isinstance(action, wire.PassEnd):
                self._slot_read(w, action.slot)
                return Ended(action.pass_no)
            if isinstance(action, wire.Rewound):
                return Rewound(action.pass_no)
            if isinstance(action, wire.Batch):
                value = await self._take(w, action, lease)
                w.took(action)
                return Delivered(value, action.seq, action.mark, action.nbytes)
            if isinstance(action, StartSuccessor):
                self._start_successor(action)
            elif isinstance(action, Switch):
                await self._switch(worker_id)
            else:
                await self._awaiting(worker_id, self._wait(worker_id))

    async def _awaiting(self, worker_id: int, wait: Awaitable[None]) -> None:
        """``wait``, with ``worker_id`` the worker :meth:`heal` judges meanwhile."""
        self._awaited = worker_id
        try:
            await wait
        finally:
            self._awaited = None

    def heal(self, silence: float) -> bool:
        """Nothing was heard for ``silence`` seconds (``timeout``) while the consumer waited:
        kill the awaited worker if it hung and a restart can replace it; its death then takes
        a crash's path. Time it spent runnable but not run (``_starved``: a loaded machine)
        does not count. True: healing, keep waiting."""
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
        """Replace worker ``worker_id`` (:class:`~aioloader.workers._phases.WorkerLost`) by a
        new one with the same shard and seeds, a stream's from ``start``; the producer asks
        again for index batches in flight."""
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
    alive = max(w.last - w.born, 1e-9)
    return WorkerStats(w.id, pid, w.batches, w.batches / alive if w.batches else 0.0,
                       min(w.busy / alive, 1.0) if w.batches else 0.0, node=node)


def told_error(who: str, told: wire.Failed | wire.BatchFailed, original: object = None, *,
               worker_id: int, pid: int | None) -> WorkerError | BatchFailure:
    """A worker's exception as the consumer sees it: a WorkerError that is also of the
    original's type where possible (``except KeyError:`` still works, as with torch), the
    worker's traceback in its message, the original as its cause (``original``: a thread
    worker's, by reference; else ``told``'s pickle when it unpickles here). One batch's error
    (``BatchFailed``: the worker went on) comes as that batch's :class:`BatchFailure`."""
    if original is None and told.pickled is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(told.pickled)
    err = worker_error_for(
        original if isinstance(original, BaseException) else None,
        f"{who} raised {told.error_repr}\n\n  Traceback from the worker:\n  "
        + told.traceback.rstrip().replace("\n", "\n  "), worker_id=worker_id, pid=pid)
    if isinstance(original, BaseException):
        err.__cause__ = original
    if isinstance(told, wire.BatchFailed):
        return BatchFailure(told.seq, err, told.mark, told.slot)
    return err
