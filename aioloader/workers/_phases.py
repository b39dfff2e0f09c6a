"""A worker's phases: the supervisor's bookkeeping as pure, synchronous transitions.

A :class:`Roster` holds a supervisor's workers and changes their phases on events, answering
with what to do; the supervisor does the awaiting and I/O around it. Nothing here touches a
socket, a process or a loop (the transitions' table: docs/architecture.md).
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

from .._errors import BatchFailure, LoaderClosedError, WorkerDied, WorkerError
from ..plane import _wire as wire


class WorkerLost(Exception):
    """Worker ``worker_id`` died within the budget: its producer restarts it (no user sees it)."""

    def __init__(self, worker_id: int) -> None:
        super().__init__(f"worker {worker_id} died")
        self.worker_id = worker_id


@dataclass
class RestartBudget:
    """A loader's ``max_worker_restarts``, across its sessions, and the deaths so far."""

    limit: int = 0
    deaths: list[WorkerDied] = field(default_factory=list)
    recycles: int = 0  # workers retired on purpose (max_batches_per_worker, max_worker_rss)
    restarts: int = 0  # deaths healed
    healed: dict[str, int] = field(default_factory=dict)  # restarts by WorkerDied.kind

    @property
    def room(self) -> bool:
        """Whether one more death would be healed."""
        return len(self.deaths) < self.limit

    def healing(self, died: WorkerDied) -> None:
        """``died`` (spent earlier) is healed by a restart."""
        self.restarts += 1
        self.healed[died.kind] = self.healed.get(died.kind, 0) + 1

    def spend(self, died: WorkerDied) -> WorkerDied | None:
        """Count ``died``: None when it may be healed, else the error that ends the run."""
        self.deaths.append(died)
        if len(self.deaths) <= self.limit:
            return None
        if self.limit == 0:
            return died
        earlier = "; ".join(str(d) for d in self.deaths[:-1])
        return WorkerDied(died.worker_id or 0, died.pid, died.exitcode,
                          f"max_worker_restarts={self.limit} were spent on earlier deaths: "
                          f"{earlier}", earlier=self.deaths[:-1])


class Phase(enum.Enum):
    STARTING = "starting"  # its start is submitted to the starter thread; not in place yet
    RUNNING = "running"
    RETIRING = "retiring"  # it said Retiring: its successor starts, or waits its turn
    HANDED_OVER = "handed over"  # new work goes to its successor; what it sent comes first
    FAILED = "failed"  # it raised: the error waits in its inbox; its exit is no death
    LOST = "lost"  # it died without a word, within the budget: to be restarted
    EXITED = "exited"  # its process ended, and nobody heals that (it failed, or we stop)
    RETIRED = "retired"  # let go (replaced, or the supervisor closed): reaped later
    REAPED = "reaped"  # joined and closed


# Phases whose process may still end on its own: its exit is news.
ALIVE = frozenset({Phase.STARTING, Phase.RUNNING, Phase.RETIRING, Phase.HANDED_OVER,
                   Phase.FAILED})

# What a worker sent, in its order; its exception takes the place of the batch it failed on.
Inbound: TypeAlias = (wire.Batch | wire.PassEnd | wire.Rewound | wire.Retiring | WorkerError
                      | BatchFailure)

L = TypeVar("L")


@dataclass(eq=False)
class WorkerState(Generic[L]):
    """The parent's view of one worker."""

    id: int
    link: L  # the supervisor's: socket, ledger, process
    phase: Phase = Phase.STARTING
    inbox: collections.deque[Inbound] = field(default_factory=collections.deque)
    sent: dict[int, list[int]] = field(default_factory=dict)  # index tasks not yet taken
    rewinding: int | None = None  # a stream's pass asked for again, until it is answered
    retiring: wire.Retiring | None = None  # what it said when it began to retire
    successor: WorkerState[L] | None = None  # started ahead of the hand-over
    died: WorkerDied | None = None  # how it died (LOST)
    born: float = field(default_factory=time.monotonic)
    last: float = 0.0  # when its latest batch was handed over
    batches: int = 0  # handed to the consumer (telemetry)
    busy: float = 0.0  # seconds the worker spent working, as it last said
    heard: float = field(default_factory=time.monotonic)  # its last word (or its birth)
    silenced: float | None = None  # killed as hung: the seconds it had been silent

    @property
    def deferred(self) -> bool:
        """Retiring, its successor not started: one hand-over at a time."""
        return (self.phase in (Phase.RETIRING, Phase.HANDED_OVER) and self.successor is None
                and self.retiring is not None)

    def took(self, msg: wire.Batch) -> None:
        self.sent.pop(msg.seq, None)
        self.batches += 1
        self.busy = msg.busy
        self.last = time.monotonic()


# ---------------------------------------------------------------------- actions

@dataclass(frozen=True, slots=True)
class StartSuccessor:
    """Start worker ``worker_id``'s successor, a stream's from ``position`` (data; None:
    index batches, and it gets the tasks not answered)."""

    worker_id: int
    position: Any


@dataclass(frozen=True, slots=True)
class Switch:
    """Put worker ``worker_id``'s successor in its place once it is up."""

    worker_id: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to hand over yet: wait for the next event."""


# An exception is raised to the consumer; a message of the worker's is handed over as it is: a
# batch (take it from the ledger), a pass end, or the answer to a rewind (what follows is the
# pass asked for, from its start).
Action: TypeAlias = (BaseException | wire.Batch | wire.PassEnd | wire.Rewound | StartSuccessor
                     | Switch | Wait)


# ---------------------------------------------------------------------- transitions

class Roster(Generic[L]):
    """A supervisor's workers and their transitions; synchronous, no I/O."""

    def __init__(self, budget: RestartBudget) -> None:
        self.budget = budget
        self.workers: list[WorkerState[L]] = []
        self.failure: BaseException | None = None  # the session's first
        self.closed = False

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    def started(self, w: WorkerState[L]) -> None:
        """``w`` is in place: its silence counts from now (a slow start is no hang)."""
        if w.phase is Phase.STARTING and not self.closed:
            w.phase = Phase.RUNNING
            w.heard = time.monotonic()

    # ------------------------------------------------------------------ the worker's side

    def on_message(self, w: WorkerState[L], msg: Inbound) -> StartSuccessor | None:
        """``w`` sent ``msg`` (a Failed message as the WorkerError it raises)."""
        if isinstance(msg, WorkerError):
            # Raised when the consumer asks this worker for its next item, after the batches
            # it sent before and those of the workers due first, as torch does (issue 19).
            if w.phase in ALIVE:
                w.phase = Phase.FAILED
            w.inbox.append(msg)
            return None
        if isinstance(msg, wire.Rewound):  # answered: a successor it starts asks nothing
            w.rewinding = None
        if not isinstance(msg, wire.Retiring):  # a batch failed: in its turn too
            w.inbox.append(msg)
            return None
        # Due for recycling: its successor starts now, ahead of the hand-over, so that the
        # consumer takes w's last batches while the new process starts.
        if w.phase not in (Phase.STARTING, Phase.RUNNING) or self.closed:
            return None
        w.phase = Phase.RETIRING
        w.retiring = msg
        if msg.position is not None:
            w.inbox.append(msg)  # the hand-over, after the batches sent before it
        # (index batches: the worker answers no more tasks; they wait for its successor)
        if any(x.successor is not None for x in self.workers):
            return None  # deferred: one hand-over at a time, unless the consumer needs it
        return self._start_successor(w)

    def _start_successor(self, w: WorkerState[L]) -> StartSuccessor:
        assert w.retiring is not None
        if w.retiring.position is None:  # index batches: new tasks go to the successor now
            w.phase = Phase.HANDED_OVER
        self.budget.recycles += 1
        return StartSuccessor(w.id, w.retiring.position)

    def add_successor(self, w: WorkerState[L], new: WorkerState[L]) -> None:
        """``new`` is ``w``'s successor, and answers the rewind ``w`` did not."""
        w.successor = new
        new.rewinding = w.rewinding

    def on_exit(self, w: WorkerState[L]) -> bool:
        """``w``'s process ended (what it sent before is read). True: a death without a
        word, to count (find its exit code, then :meth:`on_death`); not where it failed
        first, or the session failed or closed."""
        if w.phase not in ALIVE:
            return False
        death = self.failure is None and w.phase is not Phase.FAILED and not self.closed
        w.phase = Phase.EXITED
        return death

    def on_death(self, w: WorkerState[L], died: WorkerDied) -> None:
        """Spend a death on ``died``: ``w`` is lost (a restart heals it), or the run fails."""
        fatal = self.budget.spend(died)
        if fatal is not None:
            self.fail(fatal)
        else:
            w.phase = Phase.LOST
            w.died = died

    # ------------------------------------------------------------------ the consumer's side

    def request(self, worker_id: int, seq: int, indices: list[int]) -> bool:
        """The consumer asks worker ``worker_id`` for batch ``seq``: True to send it now.
        A worker handed over answers no more: its successor gets the tasks it did not
        answer, in order, when it takes over."""
        w = self.workers[worker_id]
        w.sent[seq] = indices
        return w.phase is not Phase.HANDED_OVER

    def rewind(self, worker_id: int, pass_no: int) -> list[WorkerState[L]]:
        """The consumer asks worker ``worker_id``'s stream for pass ``pass_no`` from its start
        (``wire.Rewound`` once answered): the workers to ask. A retiring one's successor is
        asked too, now or as it starts (:meth:`add_successor`), before its first batch: none
        retires in the pass dropped, and the chain of hand-overs ends."""
        w = self.workers[worker_id]
        asked = [w] if w.successor is None else [w, w.successor]
        for x in asked:
            x.rewinding = pass_no
        return asked

    def next_step(self, worker_id: int) -> Action:
        """What to do for the consumer, who wants worker ``worker_id``'s next item."""
        w = self.workers[worker_id]
        while True:
            if self.failure is not None:
                return self.failure
            if self.closed:
                return LoaderClosedError("the loader was closed")
            if not w.inbox:
                break
            msg = w.inbox.popleft()
            if isinstance(msg, WorkerError):
                self.fail(msg)
                return msg
            if isinstance(msg, BatchFailure):  # that batch's error; the session goes on
                w.sent.pop(msg.seq, None)
                return msg
            if isinstance(msg, wire.Retiring):  # a stream's batches before it are taken
                if w.phase is Phase.RETIRING:
                    w.phase = Phase.HANDED_OVER
                continue
            return msg
        if w.phase is Phase.LOST:  # what it sent before dying was taken first
            return WorkerLost(worker_id)
        if w.deferred and (w.phase is Phase.HANDED_OVER or w.sent):
            return self._start_successor(w)  # the consumer needs this one now: no waiting
        if w.successor is not None and w.phase is Phase.HANDED_OVER:
            return Switch(worker_id)
        return Wait()

    def switched(self, worker_id: int) -> StartSuccessor | None:
        """Worker ``worker_id``'s successor is up and takes its place, and its tasks."""
        old = self.workers[worker_id]
        new = old.successor
        assert new is not None
        old.successor = None
        self.workers[worker_id] = new
        new.sent = old.sent
        old.phase = Phase.RETIRED
        if self.closed:
            return None
        self.started(new)
        for waiting in self.workers:
            if waiting.deferred:
                return self._start_successor(waiting)
        return None

    def restart(self, worker_id: int,
                new: WorkerState[L]) -> tuple[WorkerDied, list[WorkerState[L]]]:
        """Worker ``worker_id`` (LOST) is replaced: how it died, and the links to close."""
        old = self.workers[worker_id]
        assert old.phase is Phase.LOST and old.died is not None, \
            f"worker {worker_id} is not lost"
        self.workers[worker_id] = new
        self.budget.healing(old.died)
        return old.died, self.retire(old)

    def hung(self, worker_id: int, silence: float, now: float) -> WorkerState[L] | None:
        """Nothing was heard for ``silence`` seconds while the consumer waits for worker
        ``worker_id``: the worker to kill and replace, if it runs, was that silent itself and
        the budget heals one more death. None: the wait times out."""
        w = self.workers[worker_id]
        if (self.closed or self.failure is not None or not self.budget.room
                or w.phase not in (Phase.RUNNING, Phase.RETIRING, Phase.HANDED_OVER)
                or w.silenced is not None or now - w.heard < silence):
            return None
        w.silenced = now - w.heard
        return w

    def retire(self, w: WorkerState[L]) -> list[WorkerState[L]]:
        """Let ``w`` go, with its successor: the workers whose links to close."""
        gone = [w]
        while (after := gone[-1].successor) is not None:
            gone[-1].successor = None
            gone.append(after)
        for x in gone:
            x.phase = Phase.RETIRED
        return gone

    def close(self) -> list[WorkerState[L]] | None:
        """Close: every worker goes (EOF), successors included; None if closed already."""
        if self.closed:
            return None
        self.closed = True
        everyone = [*self.workers, *(w.successor for w in self.workers if w.successor)]
        for w in everyone:
            w.phase = Phase.RETIRED
        return everyone
