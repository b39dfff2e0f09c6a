"""Owns the worker processes (or threads) of one session: start, watch, stop, reap.

The parent side of every worker is one non-blocking socket whose fd the running event loop
watches with ``add_reader``, plus the process sentinel, watched the same way, so that a
worker that dies without a word is noticed at once. No polling: the loop wakes on bytes, on
EOF and on process exit. Readers are attached only while an epoch runs, so a session can
outlive one event loop and serve the next.

The supervisor turns wire messages into what sessions want (:class:`Delivered` values and
:class:`Ended` passes) through each worker's :class:`~aioloader._dataplane.SlotLedger`; it
has no batch logic of its own. Thread workers (``_threads.ThreadWorker``) go through the same
paths: a handle that looks like a process, a socket, and a ledger of batches by reference.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing.process
import os
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeAlias

import torch.multiprocessing

from . import _wire as wire
from ._dataplane import Ledger, RefLedger, Shelf, SlotLedger
from ._errors import (
    LoaderClosedError,
    SourcePicklingError,
    WorkerDied,
    WorkerError,
    describe_exit,
    worker_error_for,
)
from ._loads import SkipLog, SkippedLoad
from ._position import ShardPosition
from ._session import GRACE, Delivered
from ._stats import ArenaStats, WorkerStats
from ._threads import ThreadWorker
from ._worker import WorkerSpec, forking, worker_main

if TYPE_CHECKING:
    from ._standby import Standby, StandbyPool

# Processes are started from one long-lived thread: starting can block (spawn writes the
# pickled spec into a pipe the child reads only once Python is up), and the thread that
# forks a child is the "parent" PR_SET_PDEATHSIG watches, so it must outlive the workers.
_STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioloader-start")

# Parent-side sockets of every live worker. A process forked later (another worker) must
# not hold them open, or a worker would never see EOF when its parent closes or dies. The
# child also detaches the socket objects it inherited: one collected there later would
# close whatever its fd number has become by then (uvloop's io_uring fd: SIGABRT, issue 9).
_PARENT_SOCKS: weakref.WeakSet[socket.socket] = weakref.WeakSet()
_REAPS: set[asyncio.Task[None]] = set()  # reaping recycled workers, until done


def _close_parent_socks_in_child() -> None:
    for sock in list(_PARENT_SOCKS):
        with contextlib.suppress(OSError):
            os.close(sock.detach())
    _PARENT_SOCKS.clear()


os.register_at_fork(after_in_child=_close_parent_socks_in_child)

# What a worker's spec carries of the user's: it must pickle for spawn and forkserver.
SPEC_PARTS = ("source", "collate_fn", "options", "worker_init_fn")


log = logging.getLogger("aioloader")


class WorkerLost(Exception):
    """Worker ``worker_id`` died and may be restarted: its producer restarts it from the
    position of the last batch the consumer took (never seen by users)."""

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


@dataclass(frozen=True, slots=True)
class Ended:
    """The worker finished pass ``pass_no`` of its shard."""

    pass_no: int


Arrival = Delivered | Ended


@dataclass(eq=False)
class WorkerState:
    """The parent's view of one worker."""

    id: int
    process: BaseProcess | ThreadWorker
    sock: socket.socket
    ledger: Ledger
    frames: wire.FrameReader = field(default_factory=wire.FrameReader)
    # What it sent, in its order; its exception takes the place of the batch it failed on.
    inbox: collections.deque[wire.Batch | wire.PassEnd | wire.Retiring | WorkerError] = field(
        default_factory=collections.deque)
    fds: collections.deque[int] = field(default_factory=collections.deque)
    outbox: bytearray = field(default_factory=bytearray)
    starting: concurrent.futures.Future[None] | None = None
    lost: WorkerDied | None = None  # died, and may be restarted
    failed: bool = False  # it raised (Failed): its exit that follows is no death
    successor: WorkerState | None = None  # started when this one said it is retiring
    handed_over: bool = False  # new work goes to the successor
    deferred: wire.Retiring | None = None  # retiring, its successor not started yet
    sent: dict[int, list[int]] = field(default_factory=dict)  # index tasks not yet taken
    born: float = field(default_factory=time.monotonic)
    last: float = 0.0  # when its latest batch was handed over
    batches: int = 0  # handed to the consumer (telemetry)
    busy: float = 0.0  # seconds the worker spent working, as it last said
    eof: bool = False
    exited: bool = False
    started: bool = False
    reaped: bool = False

    @property
    def pid(self) -> int | None:
        return self.process.pid


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
        self.skips = skips if skips is not None else SkipLog()  # on_error="skip"
        self.workers: list[WorkerState] = []
        self.failure: BaseException | None = None
        self.closed = False
        self.last_heard = time.monotonic()  # any word from any worker: the timeout's clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reaping = threading.Lock()
        self._retired: list[WorkerState] = []  # replaced processes, reaped at the end
        self.standby = standby  # spawn: the loader's warm processes, for the first start
        self._standbys: list[Standby] = []  # taken from it and not used yet

    # ------------------------------------------------------------------ start

    def check_picklable(self) -> None:
        """With spawn/forkserver the spec travels pickled: fail before starting anything."""
        if self.start_method == "fork" or self.spec.threaded:
            return
        check_picklable({name: getattr(self.spec, name) for name in SPEC_PARTS},
                        self.start_method)

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
                assert w.starting is not None
                # Shielded: cancelling the wait must not cancel a start still queued in the
                # starter thread (its child socket would never be closed); reaping waits.
                await asyncio.shield(asyncio.wrap_future(w.starting))
        except BaseException:
            await self.aclose(0.0)
            raise

    def _spawn(self, spec: WorkerSpec, standby: Standby | None = None) -> WorkerState:
        """A worker registered and submitted for starting (see :meth:`start`); with
        ``standby``, that process becomes the worker unless it is gone."""
        k = spec.worker_id
        parent, child = socket.socketpair()
        _PARENT_SOCKS.add(parent)
        parent.setblocking(False)
        holder: list[WorkerState] = []  # a slot goes back to the process it belongs to

        def release(slot: int) -> None:
            self._send_to(holder[0], wire.Release(slot))

        proc: BaseProcess | ThreadWorker
        ledger: Ledger
        if spec.threaded:
            shelf = Shelf()
            proc = ThreadWorker(spec, child, shelf, f"aioloader-worker-{k}")
            ledger = RefLedger(self.spec.slots, release, shelf)
        else:
            ctx: Any = torch.multiprocessing.get_context(self.start_method)
            if self.start_method == "forkserver":
                ctx.set_forkserver_preload(_preload(self.spec.source))
            proc = ctx.Process(target=worker_main, args=(spec, child), daemon=True,
                               name=f"aioloader-worker-{k}")
            ledger = SlotLedger(self.spec.slots, release, lease=self.lease)
        w = WorkerState(k, proc if standby is None else standby.process, parent, ledger)
        holder.append(w)
        if standby is not None:
            assert isinstance(proc, BaseProcess)
            w.starting = _STARTER.submit(_hand_off, w, spec, child, standby, proc)
        else:
            w.starting = _STARTER.submit(_start_process, w, child)
        return w

    def _retire(self, w: WorkerState) -> None:
        """Let ``w`` go: EOF tells it to exit; it is reaped with the others (or at once by
        :meth:`_reap_retired`)."""
        if self._loop is not None and w.started:
            self._unwatch(w)
        _PARENT_SOCKS.discard(w.sock)
        w.sock.close()
        while w.fds:
            os.close(w.fds.popleft())
        w.ledger.close()  # leased batches keep their mapping until they go
        self._retired.append(w)
        if w.successor is not None:  # retiring when it died: its successor goes too
            self._retire(w.successor)
            w.successor = None

    async def _reap_retired(self) -> None:
        """Wait for retired processes off the loop, so they do not linger as zombies."""
        await asyncio.get_running_loop().run_in_executor(None, self._reap, GRACE, True)

    async def _switch(self, worker_id: int) -> WorkerState:
        """Worker ``worker_id``'s successor takes its place (recycling)."""
        old = self.workers[worker_id]
        new = old.successor
        assert new is not None and new.starting is not None
        old.successor = None
        await asyncio.shield(asyncio.wrap_future(new.starting))
        self.workers[worker_id] = new
        new.sent = old.sent  # what the retiring worker did not answer, in order
        for seq, indices in new.sent.items():
            self._send_to(new, wire.Task(seq, indices))
        self._retire(old)
        if self._loop is not None and not self.closed:
            self._watch(new)
        task = asyncio.get_running_loop().create_task(self._reap_retired())
        _REAPS.add(task)
        task.add_done_callback(_REAPS.discard)
        for waiting in self.workers:  # the next hand-over that waited for this one
            if waiting.deferred is not None and waiting.lost is None:
                self._start_successor(waiting, waiting.deferred)
                break
        return new

    async def restart(self, worker_id: int, start: ShardPosition | None = None) -> None:
        """Replace worker ``worker_id``, which died (:class:`WorkerLost`), by a new process
        with the same shard and seeds; a stream's starts at ``start``."""
        old = self.workers[worker_id]
        died = old.lost
        assert died is not None, f"worker {worker_id} is not lost"
        self._retire(old)
        spec = self.spec.for_worker(worker_id)
        if start is not None:
            spec = spec.starting_at(start, self.num_workers)
        new = self._spawn(spec)
        self.workers[worker_id] = new
        self.budget.restarts += 1
        count = len(self.budget.deaths)
        log.warning("worker %d (pid %s) died: %s; restarting it (restart %d of "
                    "max_worker_restarts=%d)%s", worker_id, died.pid,
                    describe_exit(died.exitcode), count, self.budget.limit,
                    f", from pass {start.pass_no} block {start.start.block}"
                    if start is not None else "")
        assert new.starting is not None
        await asyncio.shield(asyncio.wrap_future(new.starting))
        if self.closed:
            return  # closed meanwhile: reaping covers it
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

    def _watch(self, w: WorkerState) -> None:
        loop = self._loop
        assert loop is not None
        if not w.eof:
            loop.add_reader(w.sock.fileno(), self._on_readable, w)
        if not w.exited:
            loop.add_reader(w.process.sentinel, self._on_exit, w)
        if w.outbox:
            loop.add_writer(w.sock.fileno(), self._on_writable, w)

    def detach(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self._loop = None
            return
        for w in self.workers:
            self._unwatch(w)
        self._loop = None

    def _unwatch(self, w: WorkerState) -> None:
        loop = self._loop
        assert loop is not None
        if w.sock.fileno() >= 0:
            loop.remove_reader(w.sock.fileno())
            loop.remove_writer(w.sock.fileno())
        if not w.reaped:
            loop.remove_reader(w.process.sentinel)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    def _on_readable(self, w: WorkerState) -> None:
        # A loop callback's exception would only be logged by asyncio while the consumer
        # waits forever: everything becomes the session's failure instead.
        try:
            self._drain(w)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, see above
            self._fail(WorkerError(
                f"reading from worker {w.id} (pid {w.pid}) failed: {exc!r}",
                worker_id=w.id, pid=w.pid))
            self._fail_cause(exc)
        self._wake()

    def _fail_cause(self, exc: BaseException) -> None:
        if self.failure is not None and self.failure.__cause__ is None:
            self.failure.__cause__ = exc

    def _drain(self, w: WorkerState) -> None:
        while not w.eof:
            try:
                data, fds, _flags, _addr = socket.recv_fds(w.sock, 1 << 18, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            w.fds.extend(fds)
            if not data:
                w.eof = True
                if self._loop is not None:
                    self._loop.remove_reader(w.sock.fileno())
                return
            self.last_heard = time.monotonic()
            for msg in w.frames.feed(data):
                self._accept(w, msg)

    def _accept(self, w: WorkerState, msg: wire.Message) -> None:
        if isinstance(msg, (wire.Batch, wire.PassEnd)):
            w.ledger.published(msg.slot)
            w.inbox.append(msg)
        elif isinstance(msg, wire.Arena):
            fd = w.fds.popleft()
            try:
                w.ledger.add_arena(fd, msg.slots, msg.slot_size)
            finally:
                os.close(fd)
        elif isinstance(msg, wire.Failed):
            # Raised when the consumer asks this worker for its next item, after the batches
            # it sent before and those of the workers due first, as torch does (issue 19).
            w.failed = True
            w.inbox.append(_worker_error(w, msg))
        elif isinstance(msg, wire.Retiring):
            self._recycle(w, msg)
        elif isinstance(msg, wire.Skipped):
            self.skips.add(SkippedLoad(msg.key, w.id, msg.attempts, msg.error))
        # wire.Progress: hearing it (last_heard) is all it is for

    def _recycle(self, w: WorkerState, msg: wire.Retiring) -> None:
        """``w`` is due for recycling: start its successor now, ahead of the hand-over, so
        that the consumer takes ``w``'s last batches while the new process starts."""
        if w.successor is not None or self.closed:
            return
        if msg.position is not None:
            w.inbox.append(msg)  # the hand-over, after the batches sent before it
        # (index batches: the worker answers no more tasks; they wait for its successor)
        if any(x.successor is not None for x in self.workers):
            w.deferred = msg  # one hand-over at a time, unless the consumer needs this one
            return
        self._start_successor(w, msg)

    def _start_successor(self, w: WorkerState, msg: wire.Retiring) -> None:
        w.deferred = None
        spec = self.spec.for_worker(w.id)
        if msg.position is not None:  # a stream: the successor goes on from there
            spec = spec.starting_at(ShardPosition.from_data(msg.position), self.num_workers)
        else:  # index batches: new tasks go to the successor from now on
            w.handed_over = True
        w.successor = self._spawn(spec)
        self.budget.recycles += 1
        log.info("worker %d (pid %s) is retiring (recycle %d); its successor starts",
                 w.id, w.pid, self.budget.recycles)

    def _on_exit(self, w: WorkerState) -> None:
        try:
            assert self._loop is not None
            self._loop.remove_reader(w.process.sentinel)
            w.exited = True
            self._drain(w)  # a Failed message sent just before exiting comes first
            if (self.failure is None and not w.failed and not self.closed
                    and self._reaping.acquire(False)):
                try:  # one thread at a time waits for a child's status: not while reaping
                    w.process.join(GRACE)
                finally:
                    self._reaping.release()
                died = WorkerDied(w.id, w.pid, w.process.exitcode)
                fatal = self.budget.spend(died)
                if fatal is not None:
                    self._fail(fatal)
                else:
                    w.lost = died
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, see _on_readable
            self._fail(WorkerDied(w.id, w.pid, w.process.exitcode))
            self._fail_cause(exc)
        self._wake()

    async def receive(self, worker_id: int, *, lease: bool = True) -> Arrival:
        """The next batch or pass end of worker ``worker_id``.

        Raises the session's first failure, or :class:`LoaderClosedError` once closed.
        A worker's own exception waits in its inbox: it is raised (and becomes the
        session's failure) when it is that worker's turn, so earlier batches come first.
        """
        w = self.workers[worker_id]
        while True:
            if self.failure is not None:
                raise self.failure
            if self.closed:
                raise LoaderClosedError("the loader was closed")
            if w.inbox:
                msg = w.inbox.popleft()
                if isinstance(msg, WorkerError):
                    self._fail(msg)
                    raise msg
                if isinstance(msg, wire.Retiring):
                    w.handed_over = True
                    continue
                if isinstance(msg, wire.PassEnd):
                    w.ledger.skip(msg.slot)
                    return Ended(msg.pass_no)
                value = await w.ledger.take(msg.slot, msg.nbytes, msg.tree, lease=lease)
                w.sent.pop(msg.seq, None)
                w.batches += 1
                w.busy = msg.busy
                w.last = time.monotonic()
                return Delivered(value, msg.seq, msg.mark, msg.nbytes)
            if w.lost is not None:  # what it sent before dying was taken first
                raise WorkerLost(worker_id)
            if w.deferred is not None and (w.handed_over or w.sent):
                # The consumer needs this one now: its hand-over waits no longer.
                self._start_successor(w, w.deferred)
            if w.successor is not None and w.handed_over:
                w = await self._switch(worker_id)
                continue
            assert self._loop is not None, "receive() outside an attached epoch"
            w.ledger.reclaim()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    # ------------------------------------------------------------------ send

    def request(self, worker_id: int, seq: int, indices: list[int]) -> None:
        """Ask worker ``worker_id`` for the batch of ``indices``, numbered ``seq``.

        Once it is retiring the task waits for its successor, which gets every task the
        retiring one did not answer, in order, when it takes over.
        """
        w = self.workers[worker_id]
        w.sent[seq] = indices
        if not w.handed_over:
            self._send_to(w, wire.Task(seq, indices))

    def _send_to(self, w: WorkerState, msg: wire.Message) -> None:
        if w.eof or self.closed or w.sock.fileno() < 0:
            return
        frame = wire.encode(msg)
        if w.outbox:
            w.outbox += frame
            return
        try:
            sent = w.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # the worker is gone; its sentinel tells why
        if sent < len(frame):
            w.outbox += frame[sent:]
            if self._loop is not None and w is self.workers[w.id]:  # else: watched later
                self._loop.add_writer(w.sock.fileno(), self._on_writable, w)

    def _on_writable(self, w: WorkerState) -> None:
        try:
            sent = w.sock.send(w.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(w.outbox)
        del w.outbox[:sent]
        if not w.outbox and self._loop is not None:
            self._loop.remove_writer(w.sock.fileno())

    # ------------------------------------------------------------------ stop

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        """Each worker's telemetry, and the arenas'; plain reads, no syscall."""
        workers = tuple(
            WorkerStats(w.id, w.process.pid if not w.reaped else None, w.batches,
                        w.batches / max(w.last - w.born, 1e-9) if w.batches else 0.0,
                        min(w.busy / max(w.last - w.born, 1e-9), 1.0) if w.batches else 0.0)
            for w in list(self.workers))
        slots = filled = leased = nbytes = 0
        for w in list(self.workers):
            usage = w.ledger.usage()
            slots += usage.slots
            filled += usage.filled
            leased += usage.leased
            nbytes += usage.bytes
        return workers, ArenaStats(slots, slots - filled - leased, filled, leased, nbytes)

    def describe(self, worker_ids: list[int]) -> str:
        return ", ".join(f"worker {k} (pid {self.workers[k].pid})" for k in worker_ids)

    async def aclose(self, grace: float = GRACE) -> None:
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

    def close(self, grace: float = GRACE) -> None:
        """Blocking version of :meth:`aclose`."""
        if self._begin_close():
            self._reap(grace)

    def _begin_close(self) -> bool:
        if self.closed:
            return False
        self.closed = True
        self.detach()
        for w in [*self.workers, *(w.successor for w in self.workers if w.successor)]:
            _PARENT_SOCKS.discard(w.sock)
            w.sock.close()  # EOF: the worker's signal to stop
            while w.fds:
                os.close(w.fds.popleft())
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
            everyone += [w for w in self.workers]
            everyone += [w.successor for w in self.workers if w.successor is not None]
        for w in everyone:  # a start in flight joins the schedule once its process exists
            if w.starting is not None and not w.reaped:
                starts[w.starting] = functools.partial(_started_process, w)
        stop_processes([], grace, starts)
        for w in everyone:
            w.reaped = w.reaped or w.started
        self._retired = [w for w in self._retired if not w.reaped]
        if retired_only:
            return
        for w in everyone:
            w.ledger.close()


Stoppable: TypeAlias = BaseProcess | ThreadWorker
# Starts in flight: each future, and what gives its process once it is done (None: none).
Starts: TypeAlias = dict[concurrent.futures.Future[Any], Callable[[], Stoppable | None]]


def stop_processes(processes: list[BaseProcess] | list[Stoppable], grace: float,
                   starts: Starts | None = None) -> None:
    """Stop ``processes`` (started, and told to go: EOF) on one schedule, measured from
    now: ``grace`` seconds to exit, then terminate, GRACE seconds later kill (a thread:
    cancel it, then stop waiting); join and close each.

    ``starts``: starts in flight, each future mapped to what gives its process once it is
    done (None: nothing started). A process that starts meanwhile joins the schedule where
    it then is (past the deadline to terminate: terminated at once), and every wait runs to
    the same deadline, so nothing adds up per worker or per start (issue 19: a stop must be
    prompt under load). Only a start that outlasts the whole schedule is waited for, and
    its process killed the moment it exists.
    """
    started: list[Stoppable] = list(processes)
    waiting: Starts = dict(starts or {})
    taken: list[str] = []  # the escalations so far, for a process that starts late
    deadline = time.monotonic() + grace
    for escalate in (None, "terminate", "kill"):
        if escalate is not None:
            taken.append(escalate)
            for p in started:
                if p.exitcode is None:
                    getattr(p, escalate)()
            deadline = time.monotonic() + GRACE
        _take_started(waiting, started, taken, deadline)
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
        if not waiting and all(p.exitcode is not None for p in started):
            break
    _take_started(waiting, started, ["kill"], None)
    for p in started:
        p.join()
        p.close()


def _take_started(waiting: Starts, started: list[Stoppable], taken: list[str],
                  deadline: float | None) -> None:
    """Wait for the starts in ``waiting`` until ``deadline`` (None: for all of them); each
    process started meanwhile gets the escalations ``taken`` so far, and joins ``started``."""
    if not waiting:
        return
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    done, _ = concurrent.futures.wait(list(waiting), timeout)
    for fut in done:
        p = waiting.pop(fut)()
        if p is None:
            continue
        if taken:  # the latest is enough: a kill needs no terminate first
            getattr(p, taken[-1])()
        started.append(p)


def check_picklable(parts: dict[str, Any], start_method: str) -> None:
    """Raise SourcePicklingError naming the first of ``parts`` (the source, the collate
    function, ...: what a worker's spec carries) that cannot be pickled as spawn and
    forkserver send it."""
    from ._standby import spawn_dumps  # it imports this module

    for name, value in parts.items():
        try:
            spawn_dumps(value)  # as the start pickles it, holding no fd
        except Exception as exc:
            raise SourcePicklingError(
                f"the {name} ({type(value).__name__}) cannot be pickled, which "
                f"start_method={start_method!r} needs to send it to the workers: "
                f"{exc!r}. Make it picklable (no lambdas, locks or open files as "
                "attributes; define classes at module level) or use start_method='fork'."
            ) from exc


def warm_forkserver(source: Any) -> None:
    """Start multiprocessing's forkserver now, in the background, preloaded for ``source``.

    Called when a loader with ``start_method="forkserver"`` is made: the server imports
    torch, aioloader and the dataset's module while the user's script goes on setting up,
    so the first epoch forks its workers from a warm server. The server is the process's
    one forkserver (multiprocessing's), kept until the process exits, as after any epoch.
    """
    def start() -> None:
        import multiprocessing.forkserver

        ctx: Any = torch.multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_preload(source))
        with contextlib.suppress(OSError):  # the first epoch then says what is wrong
            multiprocessing.forkserver.ensure_running()

    _STARTER.submit(start)


def _preload(source: Any) -> list[str]:
    """What a forkserver imports once, before it forks any worker: the main module (the
    multiprocessing default this list replaces), torch and aioloader, and the module of the
    source's class. Each worker then forks from it warm instead of importing them itself
    (0.7-0.9 s a worker measured here, issue 13). Only the server's first start reads it;
    a module that fails to import is skipped there. A spawn loader's standby processes
    import the same list (aioloader/_standby.py)."""
    modules = ["__main__", "aioloader._worker"]
    home = getattr(type(source), "__module__", None)
    if isinstance(home, str) and home not in ("__main__", "builtins"):
        modules.append(home)
    return modules


def _started_process(w: WorkerState) -> Stoppable | None:
    """``w``'s process once its start is done; None if that start failed before it."""
    return w.process if w.started else None


def _start_process(w: WorkerState, child: socket.socket) -> None:
    """In the starter thread: start ``w``'s process, then drop the child's end."""
    if w.sock.fileno() < 0:
        # Stopped (or retired) while this start waited for its turn: never started, so a
        # stop waits for no start queued behind one in flight (issue 19).
        child.close()
        return
    if isinstance(w.process, ThreadWorker):
        w.process.start()  # the thread owns the child's end and closes it
        w.started = True
        return
    try:
        with forking():  # fork: the worker never finalizes what it inherits (issue 19)
            w.process.start()
        w.started = True
        # multiprocessing polls every child it knows of whenever any process starts
        # (process._cleanup): another loader's start would then race our reaping for the
        # exit status (waitpid), and Process.close() could find "still running". The
        # supervisor alone reaps its workers.
        multiprocessing.process._children.discard(w.process)  # type: ignore[attr-defined]
    finally:
        child.close()


def _hand_off(w: WorkerState, spec: WorkerSpec, child: socket.socket, standby: Standby,
              fresh: BaseProcess) -> None:
    """In the starter thread: ``standby`` becomes ``w``, given ``spec`` (pickled now, so it
    carries the dataset as it is when the epoch starts) and ``child``; where the standby is
    gone, the process ``fresh`` is started instead."""
    if w.sock.fileno() < 0:  # stopped before its turn (see _start_process): it goes unused
        standby.dismiss()
        w.started = standby.started_process() is not None  # reaped with the others
        child.close()
        return
    try:
        taken = standby.hand_off(spec, child)
    except BaseException:
        w.started = True  # it runs, and sees EOF: reaped with the others
        child.close()
        raise
    if taken:
        w.started = True
        child.close()
        return
    w.process = fresh
    _start_process(w, child)


def _worker_error(w: WorkerState, msg: wire.Failed) -> WorkerError:
    """The worker's exception as the consumer sees it: a WorkerError that is also of the
    original's type where possible (``except KeyError:`` still works, as with torch), the
    worker's traceback in its message, the original as its ``__cause__`` (a thread
    worker's by reference, so even one that does not pickle)."""
    original: BaseException | None = None
    if isinstance(w.ledger, RefLedger):
        original = w.ledger.shelf.error
    elif msg.pickled is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(msg.pickled)
    err = worker_error_for(
        original if isinstance(original, BaseException) else None,
        f"worker {w.id} (pid {w.pid}) raised {msg.error_repr}\n\n"
        "  Traceback from the worker:\n  " + msg.traceback.rstrip().replace("\n", "\n  "),
        worker_id=w.id, pid=w.pid)
    if isinstance(original, BaseException):
        err.__cause__ = original
    return err
