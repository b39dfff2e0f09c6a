"""Owns the worker processes (or threads) of one session: start, watch, stop, reap.

The parent side of every worker is one non-blocking socket whose fd the running event loop
watches with ``add_reader``, plus the process sentinel, watched the same way, so that a
worker that dies without a word is noticed at once. No polling: the loop wakes on bytes, on
EOF and on process exit. Readers are attached only while an epoch runs, so a session can
outlive one event loop and serve the next.

Decide, then await: which phase each worker is in and what a message, an exit or a
consumer's request leads to is the :class:`~aioloader._phases.Roster`'s, pure and
synchronous; the supervisor executes its actions and does the I/O and the awaiting around
them. Starting and stopping processes is aioloader/_starting.py's. Batches reach sessions as
:class:`Received` values and :class:`Ended` passes, through each worker's
:class:`~aioloader._dataplane.SlotLedger`; the supervisor has no batch logic of its own.
Thread workers (``_threads.ThreadWorker``) go through the same paths: a handle that looks
like a process, a socket, and a ledger of batches by reference.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pickle
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TypeAlias, overload

from . import _wire as wire
from ._dataplane import Ledger, RefLedger, Shelf, SlotLedger
from ._errors import BatchFailure, WorkerDied, WorkerError, describe_exit, worker_error_for
from ._loads import SkipLog, SkippedLoad
from ._phases import (
    ALIVE,
    Deliver,
    EndPass,
    Inbound,
    Phase,
    Raise,
    RestartBudget,
    Roster,
    StartSuccessor,
    Switch,
    WorkerState,
)
from ._position import ShardPosition
from ._starting import (
    EXIT_GRACE,
    Handle,
    Launch,
    Standby,
    StandbyPool,
    Starts,
    check_picklable,
    close_parent,
    hand_off_worker,
    new_process,
    socket_pair,
    start_worker,
    stop_processes,
)
from ._stats import ArenaStats, WorkerStats
from ._threads import ThreadWorker
from ._worker import WorkerSpec

log = logging.getLogger("aioloader")


def cpu_queued_ns(pid: int | None) -> int | None:
    """Nanoseconds process ``pid``'s main thread has spent runnable but waiting for a CPU
    (Linux's ``/proc/PID/schedstat``); None where that is not known. A starved worker on a
    loaded machine accrues it; a stopped or blocked one (a hang) does not."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None

_REAPS: set[asyncio.Task[None]] = set()  # reaping recycled workers, until done


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


Arrival = Received | Ended


@dataclass(eq=False)
class Link:
    """The parent's end of one worker: its socket and what goes through it, its ledger, its
    start. The pipe's EOF is a fact of the link, apart from the worker's phase."""

    sock: socket.socket
    ledger: Ledger
    launch: Launch
    frames: wire.FrameReader = field(default_factory=wire.FrameReader)
    fds: collections.deque[int] = field(default_factory=collections.deque)
    outbox: bytearray = field(default_factory=bytearray)
    eof: bool = False

    @property
    def process(self) -> Handle:
        return self.launch.process

    @property
    def pid(self) -> int | None:
        return self.launch.process.pid

    def close(self) -> None:
        """EOF: the worker's signal to stop; fds received and not taken go too."""
        close_parent(self.sock)
        while self.fds:
            os.close(self.fds.popleft())


Worker: TypeAlias = WorkerState[Link]


class Supervisor:
    """Starts ``num_workers`` processes for ``spec`` and moves messages to and from them."""

    def __init__(self, spec: WorkerSpec, num_workers: int, start_method: str, *,
                 lease: bool = True, budget: RestartBudget | None = None,
                 skips: SkipLog | None = None, standby: StandbyPool | None = None) -> None:
        self.spec = spec
        self.num_workers = num_workers
        self.start_method = start_method
        self.lease = lease
        self.budget = budget if budget is not None else RestartBudget()
        self.roster: Roster[Link] = Roster(self.budget)
        self.skips = skips if skips is not None else SkipLog()  # on_error="skip"
        self.last_heard = time.monotonic()  # any word from any worker: the timeout's clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reaping = threading.Lock()
        self._retired: list[Worker] = []  # replaced processes, reaped at the end
        self.standby = standby  # spawn: the loader's warm processes, for the first start
        self._standbys: list[Standby] = []  # taken from it and not used yet
        self._awaited: int | None = None  # the worker the consumer waits for in receive()
        # (worker id, its last word, ns it had waited for a CPU) when that wait began: what
        # it waits for a CPU after that is the machine's load, not its silence (heal)
        self._queued: tuple[int, float, int | None] | None = None
        self._restarting = False  # a replacement's start is awaited: that is no silence

    @property
    def workers(self) -> list[Worker]:
        return self.roster.workers

    @property
    def failure(self) -> BaseException | None:
        return self.roster.failure

    @property
    def closed(self) -> bool:
        return self.roster.closed

    # ------------------------------------------------------------------ start

    def check_picklable(self) -> None:
        """With spawn/forkserver the spec travels pickled: fail before starting anything."""
        if self.start_method == "fork" or self.spec.workers.threaded:
            return
        check_picklable(self.spec.parts(), self.start_method)

    async def start(self) -> None:
        """Start every worker; cancellation-safe.

        Each worker is registered before its process is submitted for starting, and the
        start itself runs to its end in the starter thread whatever happens here, so
        reaping (which waits for pending starts) always sees every process. With the
        loader's standby processes (spawn), the first start takes them all; those it does
        not use are reaped with the workers.
        """
        if self.standby is not None:
            self._standbys = self.standby.take_all()
        try:
            self.check_picklable()
            for k in range(self.num_workers):
                standby = self._standbys[0] if self._standbys else None
                self.workers.append(self._spawn(self.spec.for_worker(k), standby))
                if standby is not None:
                    self._standbys.remove(standby)
            for w in self.workers:
                # Shielded: cancelling the wait must not cancel a start still queued in the
                # starter thread (its child socket would never be closed); reaping waits.
                await asyncio.shield(asyncio.wrap_future(w.link.launch.future))
                self.roster.started(w)
        except BaseException:
            await self.aclose(0.0)
            raise

    def _spawn(self, spec: WorkerSpec, standby: Standby | None = None) -> Worker:
        """A worker registered and submitted for starting (see :meth:`start`); with
        ``standby``, that process becomes the worker unless it is gone."""
        k = spec.worker_id
        parent, child = socket_pair()
        parent.setblocking(False)
        holder: list[Worker] = []  # a slot goes back to the process it belongs to

        def release(slot: int) -> None:
            self._send_to(holder[0], wire.Release(slot))

        ledger: Ledger
        if spec.workers.threaded:
            shelf = Shelf()
            ledger = RefLedger(self.spec.workers.slots, release, shelf)
            thread = ThreadWorker(spec, child, shelf, f"aioloader-worker-{k}")
            launch = start_worker(thread, parent, child)
        else:
            ledger = SlotLedger(self.spec.workers.slots, release, lease=self.lease)
            fresh = new_process(spec, child, self.start_method)
            launch = (start_worker(fresh, parent, child) if standby is None
                      else hand_off_worker(standby, spec, fresh, parent, child))
        w = WorkerState(k, Link(parent, ledger, launch))
        holder.append(w)
        return w

    def _let_go(self, gone: list[Worker]) -> None:
        """Close the links of ``gone`` (retired: EOF tells each to exit); they are reaped
        with the others (or at once by :meth:`_reap_retired`)."""
        for w in gone:
            if self._loop is not None and w.link.launch.started:
                self._unwatch(w)
            w.link.close()
            w.link.ledger.close()  # leased batches keep their mapping until they go
            self._retired.append(w)

    async def _reap_retired(self) -> None:
        """Wait for retired processes off the loop, so they do not linger as zombies."""
        await asyncio.get_running_loop().run_in_executor(None, self._reap, EXIT_GRACE, True)

    def _start_successor(self, action: StartSuccessor) -> None:
        w = self.workers[action.worker_id]
        spec = self.spec.for_worker(w.id)
        if action.position is not None:  # a stream: the successor goes on from there
            spec = spec.starting_at(ShardPosition.from_data(action.position),
                                    self.num_workers)
        self.roster.add_successor(w, self._spawn(spec))
        log.info("worker %d (pid %s) is retiring (recycle %d); its successor starts",
                 w.id, w.link.pid, self.budget.recycles)

    async def _switch(self, worker_id: int) -> None:
        """Worker ``worker_id``'s successor takes its place (recycling)."""
        old = self.workers[worker_id]
        new = old.successor
        assert new is not None
        await asyncio.shield(asyncio.wrap_future(new.link.launch.future))
        then = self.roster.switched(worker_id)
        if self.closed:
            return  # closing covered both (the successor was still the old one's)
        for seq, indices in new.sent.items():  # what the retiring one did not answer
            self._send_to(new, wire.Task(seq, indices))
        self._let_go([old])
        if self._loop is not None:
            self._watch(new)
        task = asyncio.get_running_loop().create_task(self._reap_retired())
        _REAPS.add(task)
        task.add_done_callback(_REAPS.discard)
        if then is not None:  # the next hand-over that waited for this one
            self._start_successor(then)

    async def restart(self, worker_id: int, start: ShardPosition | None = None) -> None:
        """Replace worker ``worker_id``, which died (:class:`~aioloader._phases.WorkerLost`),
        by a new process with the same shard and seeds; a stream's starts at ``start``."""
        spec = self.spec.for_worker(worker_id)
        if start is not None:
            spec = spec.starting_at(start, self.num_workers)
        new = self._spawn(spec)
        died, gone = self.roster.restart(worker_id, new)
        self._let_go(gone)
        how = (f"hung: no word for {died.hung:.1f} s while a batch was owed; killed"
               if died.hung is not None else f"died: {describe_exit(died.exitcode)}")
        log.warning("worker %d (pid %s) %s (a %s); restarting it (restart %d of "
                    "max_worker_restarts=%d)%s", worker_id, died.pid, how, died.kind,
                    len(self.budget.deaths), self.budget.limit,
                    f", from pass {start.pass_no} block {start.start.block}"
                    if start is not None else "")
        self._restarting = True
        try:
            await asyncio.shield(asyncio.wrap_future(new.link.launch.future))
        finally:
            self._restarting = False
        if self.closed:
            return  # closed meanwhile: reaping covers it
        self.roster.started(new)
        self.last_heard = time.monotonic()  # the replacement is up: a sign of life
        if self._loop is not None:
            self._watch(new)

    # ------------------------------------------------------------------ watch

    def attach(self) -> None:
        """Watch every worker's socket and sentinel on the running loop (none once closed:
        a close from another thread can come between start and attach, and a thread
        worker's reader can run before its parent attaches; receive() then says closed)."""
        if self.closed:
            return
        self._loop = asyncio.get_running_loop()
        for w in self.workers:
            self._watch(w)

    def _watch(self, w: Worker) -> None:
        loop = self._loop
        assert loop is not None
        link = w.link
        if not link.eof:
            loop.add_reader(link.sock.fileno(), self._on_readable, w)
        if w.phase in ALIVE:  # a sentinel that fired fires again: its exit is known
            loop.add_reader(link.process.sentinel, self._on_exit, w)
        if link.outbox:
            loop.add_writer(link.sock.fileno(), self._on_writable, w)

    def detach(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self._loop = None
            return
        for w in self.workers:
            self._unwatch(w)
        self._loop = None

    def _unwatch(self, w: Worker) -> None:
        loop = self._loop
        assert loop is not None
        if w.link.sock.fileno() >= 0:
            loop.remove_reader(w.link.sock.fileno())
            loop.remove_writer(w.link.sock.fileno())
        if w.phase is not Phase.REAPED:  # a closed process has no sentinel
            loop.remove_reader(w.link.process.sentinel)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail_cause(self, exc: BaseException) -> None:
        if self.failure is not None and self.failure.__cause__ is None:
            self.failure.__cause__ = exc

    def _on_readable(self, w: Worker) -> None:
        # A loop callback's exception would only be logged by asyncio while the consumer
        # waits forever: everything becomes the session's failure instead.
        try:
            self._drain(w)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, see above
            self.roster.fail(WorkerError(
                f"reading from worker {w.id} (pid {w.link.pid}) failed: {exc!r}",
                worker_id=w.id, pid=w.link.pid))
            self._fail_cause(exc)
        self._wake()

    def _drain(self, w: Worker) -> None:
        link = w.link
        while not link.eof:
            try:
                data, fds, _flags, _addr = socket.recv_fds(link.sock, 1 << 18, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            link.fds.extend(fds)
            if not data:
                link.eof = True
                if self._loop is not None:
                    self._loop.remove_reader(link.sock.fileno())
                return
            self.last_heard = w.heard = time.monotonic()
            for msg in link.frames.feed(data):
                self._accept(w, msg)

    def _accept(self, w: Worker, msg: wire.Message) -> None:
        if isinstance(msg, wire.Arena):
            fd = w.link.fds.popleft()
            try:
                w.link.ledger.add_arena(fd, msg.slots, msg.slot_size)
            finally:
                os.close(fd)
        elif isinstance(msg, wire.Skipped):
            self.skips.add(SkippedLoad(msg.key, w.id, msg.attempts, msg.error))
        elif isinstance(msg, (wire.Batch, wire.PassEnd, wire.Retiring, wire.Failed,
                              wire.BatchFailed)):
            if isinstance(msg, (wire.Batch, wire.PassEnd)):
                w.link.ledger.published(msg.slot)
            inbound: Inbound = msg if not isinstance(msg, (wire.Failed, wire.BatchFailed)) \
                else _worker_error(w, msg)
            action = self.roster.on_message(w, inbound)
            if action is not None:
                self._start_successor(action)
        # wire.Progress: hearing it (last_heard) is all it is for

    def _on_exit(self, w: Worker) -> None:
        process = w.link.process
        try:
            assert self._loop is not None
            self._loop.remove_reader(process.sentinel)
            self._drain(w)  # a Failed message sent just before exiting comes first
            if self.roster.on_exit(w) is not None and self._reaping.acquire(False):
                try:  # one thread at a time waits for a child's status: not while reaping
                    process.join(EXIT_GRACE)
                finally:
                    self._reaping.release()
                self.roster.on_death(w, WorkerDied(w.id, process.pid, process.exitcode,
                                                   hung=w.silenced))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, see _on_readable
            self.roster.fail(WorkerDied(w.id, process.pid, process.exitcode))
            self._fail_cause(exc)
            self.roster.on_exit(w)  # the session failed: an exit, no death to count
        self._wake()

    async def receive(self, worker_id: int, *, lease: bool = True) -> Arrival:
        """The next batch or pass end of worker ``worker_id``.

        Raises the session's first failure, or :class:`LoaderClosedError` once closed.
        A worker's own exception waits in its inbox: it is raised (and becomes the
        session's failure) when it is that worker's turn, so earlier batches come first.
        A worker that died is :class:`~aioloader._phases.WorkerLost` once what it sent
        before is taken.
        """
        while True:
            action = self.roster.next_step(worker_id)
            w = self.workers[worker_id]
            if isinstance(action, Raise):
                raise action.error
            if isinstance(action, EndPass):
                w.link.ledger.skip(action.msg.slot)
                return Ended(action.msg.pass_no)
            if isinstance(action, Deliver):
                msg = action.msg
                value = await w.link.ledger.take(msg.slot, msg.nbytes, msg.tree, lease=lease)
                w.took(msg)
                return Received(value, msg.seq, msg.mark, msg.nbytes)
            if isinstance(action, StartSuccessor):
                self._start_successor(action)
                continue
            if isinstance(action, Switch):
                await self._switch(worker_id)
                continue
            assert self._loop is not None, "receive() outside an attached epoch"
            w.link.ledger.reclaim()
            if self.budget.room and not self.spec.workers.threaded and (
                    self._queued is None or self._queued[:2] != (worker_id, w.heard)):
                self._queued = (worker_id, w.heard, cpu_queued_ns(w.link.pid))
            self._waiter = self._loop.create_future()
            self._awaited = worker_id
            try:
                await self._waiter
            finally:
                self._waiter = self._awaited = None

    def heal(self, silence: float) -> bool:
        """Nothing was heard for ``silence`` seconds (the loader's ``timeout``) while the
        consumer waited: kill the worker it waits for if that one hung (a deadlock in user
        code, a read that never returns, SIGSTOP) and a restart can replace it. SIGKILL
        ends a stopped process too; its exit then takes a crash's path (its work is built
        again, exactly once, in order). A worker that spent part of that silence runnable
        but not run (``cpu_queued_ns``: a loaded machine) is slow, not hung: only the rest
        counts. True: healing, keep waiting. Thread workers cannot be killed: a hung one
        times out."""
        if self._restarting:
            return True
        if self._awaited is not None and self.workers[self._awaited].phase is Phase.LOST:
            return True  # died within the budget: the consumer, woken, restarts it next
        if self._awaited is None or self.spec.workers.threaded:
            return False
        awaited = self.workers[self._awaited]
        if awaited.silenced is not None and awaited.phase in ALIVE:
            return True  # killed already: its exit is on its way (a loaded machine)
        starved = self._starved(awaited)
        if self.budget.room and time.monotonic() - awaited.heard - starved < silence:
            # runnable but not run (a loaded machine): slow, not silent; wait on
            log.debug("worker %d (pid %s) is silent but waited %.1f s for a CPU: not hung",
                      awaited.id, awaited.link.pid, starved)
            return True
        w = self.roster.hung(self._awaited, silence, time.monotonic())
        if w is None or w.link.pid is None:
            return False
        assert w.silenced is not None
        log.warning("worker %d (pid %s) hung: no word for %.1f s (timeout=%s) while the "
                    "consumer waited for its batch; killing it (SIGKILL) to replace it",
                    w.id, w.link.pid, w.silenced, silence)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.link.pid, signal.SIGKILL)
        return True

    def _starved(self, w: Worker) -> float:
        """Seconds ``w`` spent runnable but not running since the consumer began to wait
        for it (0.0 when that is not known)."""
        if self._queued is None or self._queued[:2] != (w.id, w.heard):
            return 0.0
        before, now = self._queued[2], cpu_queued_ns(w.link.pid)
        return 0.0 if before is None or now is None else max(0, now - before) / 1e9

    # ------------------------------------------------------------------ send

    def request(self, worker_id: int, seq: int, indices: list[int]) -> None:
        """Ask worker ``worker_id`` for the batch of ``indices``, numbered ``seq``.

        Once it is handed over the task waits for its successor, which gets every task the
        retiring one did not answer, in order, when it takes over.
        """
        if self.roster.request(worker_id, seq, indices):
            self._send_to(self.workers[worker_id], wire.Task(seq, indices))

    def _send_to(self, w: Worker, msg: wire.Message) -> None:
        link = w.link
        if link.eof or self.closed or link.sock.fileno() < 0:
            return
        frame = wire.encode(msg)
        if link.outbox:
            link.outbox += frame
            return
        try:
            sent = link.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # the worker is gone; its sentinel tells why
        if sent < len(frame):
            link.outbox += frame[sent:]
            if self._loop is not None and w is self.workers[w.id]:  # else: watched later
                self._loop.add_writer(link.sock.fileno(), self._on_writable, w)

    def _on_writable(self, w: Worker) -> None:
        link = w.link
        try:
            sent = link.sock.send(link.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(link.outbox)
        del link.outbox[:sent]
        if not link.outbox and self._loop is not None:
            self._loop.remove_writer(link.sock.fileno())

    # ------------------------------------------------------------------ stop

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        """Each worker's telemetry, and the arenas'; plain reads, no syscall."""
        workers = tuple(
            WorkerStats(w.id, w.link.pid if w.phase is not Phase.REAPED else None, w.batches,
                        w.batches / max(w.last - w.born, 1e-9) if w.batches else 0.0,
                        min(w.busy / max(w.last - w.born, 1e-9), 1.0) if w.batches else 0.0)
            for w in list(self.workers))
        slots = filled = leased = nbytes = 0
        for w in list(self.workers):
            usage = w.link.ledger.usage()
            slots += usage.slots
            filled += usage.filled
            leased += usage.leased
            nbytes += usage.bytes
        return workers, ArenaStats(slots, slots - filled - leased, filled, leased, nbytes)

    def describe(self, worker_ids: list[int]) -> str:
        named = ", ".join(f"worker {k} (pid {self.workers[k].link.pid})" for k in worker_ids)
        if self.spec.workers.threaded:
            return (f"{named} (thread workers cannot be killed, so a hung one is never "
                    "replaced: worker_type='process' with max_worker_restarts heals it)")
        if self.budget.limit == 0:
            return (f"{named} (with max_worker_restarts=1 or more, a worker that hangs is "
                    "killed and replaced)")
        if not self.budget.room:
            return (f"{named} (max_worker_restarts={self.budget.limit} spent: no restart "
                    "left to replace a hung worker)")
        return named

    async def aclose(self, grace: float) -> None:
        """Stop every worker and wait for it, without blocking the loop.

        ``grace``: how long a worker may take to leave on EOF before it is terminated (an
        error path passes 0: nothing is waiting for that worker's last words).
        """
        if not self._begin_close():
            return
        try:
            reaped = asyncio.get_running_loop().run_in_executor(None, self._reap, grace)
        except RuntimeError:  # its executor is shut down (asyncio.run is ending): here, now
            self._reap(0.0)
            return
        try:
            # Shielded: a cancellation (the loop shutting down, say) must not stop the
            # reaping half-way; the executor's thread finishes it whatever happens here.
            await asyncio.shield(reaped)
        except asyncio.CancelledError:
            self._reap(0.0)
            raise

    def close(self, grace: float) -> None:
        """Blocking version of :meth:`aclose`."""
        if self._begin_close():
            self._reap(grace)

    def _begin_close(self) -> bool:
        everyone = self.roster.close()
        if everyone is None:
            return False
        self.detach()
        for w in everyone:
            w.link.close()  # EOF: the worker's signal to stop
        self._wake()
        return True

    def _reap(self, grace: float, retired_only: bool = False) -> None:
        with self._reaping:  # the executor's thread and a cancelled caller may both get here
            self._reap_locked(grace, retired_only)

    def _reap_locked(self, grace: float, retired_only: bool = False) -> None:
        everyone = list(self._retired)
        starts: Starts = {}
        if not retired_only:
            if self.standby is not None:  # a start that failed before it used them all
                unused, self._standbys = self._standbys, []
                for standby in unused:
                    standby.dismiss()
                    starts[standby.started] = standby.started_process
            everyone += self.workers
            everyone += [w.successor for w in self.workers if w.successor is not None]
        for w in everyone:  # a start in flight joins the schedule once its process exists
            if w.phase is not Phase.REAPED:
                starts[w.link.launch.future] = w.link.launch.started_process
        stop_processes([], grace, starts)
        for w in everyone:
            if w.link.launch.started:
                w.phase = Phase.REAPED  # out of the loop's hands: retired, or closed
        self._retired = [w for w in self._retired if w.phase is not Phase.REAPED]
        if retired_only:
            return
        for w in everyone:
            w.link.ledger.close()


@overload
def _worker_error(w: Worker, msg: wire.Failed) -> WorkerError: ...
@overload
def _worker_error(w: Worker, msg: wire.BatchFailed) -> BatchFailure: ...
def _worker_error(w: Worker, msg: wire.Failed | wire.BatchFailed) -> WorkerError | BatchFailure:
    """The worker's exception as the consumer sees it: a WorkerError that is also of the
    original's type where possible (``except KeyError:`` still works, as with torch), the
    worker's traceback in its message, the original as its ``__cause__`` (a thread
    worker's by reference, so even one that does not pickle). One batch's error comes as
    that batch's :class:`BatchFailure`."""
    original: BaseException | None = None
    ledger = w.link.ledger
    if isinstance(ledger, RefLedger):
        original = (ledger.shelf.error if isinstance(msg, wire.Failed)
                    else ledger.shelf.errors.pop(msg.seq, None))
    elif msg.pickled is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(msg.pickled)
    pid = w.link.pid
    err = worker_error_for(
        original if isinstance(original, BaseException) else None,
        f"worker {w.id} (pid {pid}) raised {msg.error_repr}\n\n"
        "  Traceback from the worker:\n  " + msg.traceback.rstrip().replace("\n", "\n  "),
        worker_id=w.id, pid=pid)
    if isinstance(original, BaseException):
        err.__cause__ = original
    return BatchFailure(msg.seq, err) if isinstance(msg, wire.BatchFailed) else err
