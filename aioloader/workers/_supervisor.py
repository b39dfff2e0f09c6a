"""The process transport: the worker processes (or threads) of one session.

The running loop watches each worker's socket and process sentinel while an epoch runs, so a
death without a word is noticed at once and nothing polls (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any

from .._errors import BatchFailure, WorkerDied, WorkerError
from .._stats import ArenaStats, WorkerStats
from ..pipeline._loads import SkipLog, SkippedLoad
from ..plane import _wire as wire
from ..plane._dataplane import Ledger, RefLedger, Shelf, SlotLedger
from ..plans._position import ShardPosition
from ._link import Link, Worker
from ._phases import (
    ALIVE,
    Inbound,
    Phase,
    RestartBudget,
    WorkerState,
)
from ._pickling import check_picklable
from ._spec import WorkerSpec
from ._standby import Standby, StandbyPool, hand_off_worker
from ._starting import (
    EXIT_GRACE,
    Starts,
    new_process,
    socket_pair,
    start_worker,
    stop_processes,
)
from ._supervising import Supervising, told_error, worker_stats
from ._threads import ThreadWorker, own_source

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


class Supervisor(Supervising[Link]):
    """Starts ``spec.workers.num_workers`` processes (or threads) for ``spec``, moves
    messages to and from them."""

    def __init__(self, spec: WorkerSpec, *, budget: RestartBudget | None = None,
                 skips: SkipLog | None = None, standby: StandbyPool | None = None) -> None:
        super().__init__(spec, budget, skips)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reaping = threading.Lock()
        self._retired: list[Worker] = []  # replaced processes, reaped at the end
        self.standby = standby  # spawn: the loader's warm processes, for the first start
        self._standbys: list[Standby] = []  # taken from it and not used yet
        # (worker id, its last word, ns it had waited for a CPU, when) the consumer's wait
        # for it began: what it waits for a CPU after that is the machine's load, not its
        # silence (heal)
        self._queued: tuple[int, float, int | None, float] | None = None

    # ------------------------------------------------------------------ start

    async def _prepare(self) -> None:
        """With the loader's standby processes (spawn), the first start takes them all;
        those it does not use are reaped with the workers. With spawn or forkserver the
        spec travels pickled: it fails here, before anything starts, if it cannot."""
        if self.standby is not None:
            self._standbys = self.standby.take_all()
        method = self.spec.workers.start_method
        if method != "fork" and not self.spec.workers.threaded:
            check_picklable(self.spec.parts(), method)

    def _new(self, worker_id: int, start: ShardPosition | None, *,
             ahead: bool = True) -> Worker:  # (it streams unasked; a Rewind is read first)
        """A worker submitted for starting, from a standby in the first start (if not gone)."""
        spec = self.spec.for_worker(worker_id)
        if start is not None:
            spec = spec.starting_at(start)
        if spec.workers.threaded:
            spec = own_source(spec)  # may refuse: before the sockets, so none leak
        parent, child = socket_pair()
        parent.setblocking(False)
        holder: list[Worker] = []  # a slot goes back to the process it belongs to

        def release(slot: int) -> None:
            self._send_to(holder[0], wire.Release(slot))

        ledger: Ledger
        if spec.workers.threaded:
            shelf = Shelf()
            ledger = RefLedger(self.spec.workers.slots, release, shelf)
            thread = ThreadWorker(spec, child, shelf, f"aioloader-worker-{worker_id}")
            launch = start_worker(thread, parent, child)
        else:
            ledger = SlotLedger(self.spec.workers.slots, release, lease=self.spec.workers.zero_copy)
            fresh = new_process(spec, child, spec.workers.start_method)
            standby = self._standbys[0] if self._standbys else None
            launch = (start_worker(fresh, parent, child) if standby is None
                      else hand_off_worker(standby, spec, fresh, parent, child))
            if standby is not None:
                self._standbys.remove(standby)
        w = WorkerState(worker_id, Link(parent, ledger, launch))
        holder.append(w)
        return w

    def _let_go(self, gone: list[Worker]) -> None:
        """EOF tells each of ``gone`` to exit; they are reaped later."""
        for w in gone:
            if self._loop is not None and w.link.launch.started:
                self._unwatch(w)
            w.link.close()
            w.link.ledger.close()  # leased batches keep their mapping until they go
            self._retired.append(w)

    async def _up(self, w: Worker) -> None:
        # Shielded: cancelling the wait must not cancel a start still queued in the
        # starter thread (its child socket would never be closed); reaping waits.
        await asyncio.shield(asyncio.wrap_future(w.link.launch.future))

    def _watch_new(self, w: Worker) -> None:
        if self._loop is not None:
            self._watch(w)

    def _named(self, w: Worker) -> str:
        return f"worker {w.id} (pid {w.link.pid})"

    def _took_over(self, new: Worker) -> None:
        self._watch_new(new)
        # Off the loop, so that retired processes do not linger as zombies.
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self._reap, EXIT_GRACE, retired_only=True))
        _REAPS.add(task)
        task.add_done_callback(_REAPS.discard)

    # ------------------------------------------------------------------ watch

    def attach(self) -> None:
        """Watch every socket and sentinel on this loop (none once closed: from another thread)."""
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

    def _on_readable(self, w: Worker) -> None:
        # A loop callback's exception would only be logged by asyncio while the consumer
        # waits forever: everything becomes the session's failure instead.
        try:
            self._drain(w)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, see above
            self.roster.fail(WorkerError(f"reading from {self._named(w)} failed: {exc!r}",
                                         worker_id=w.id, pid=w.link.pid))
            self._fail_cause(exc)
        self._wake()

    def _drain(self, w: Worker) -> None:
        link = w.link
        while (got := link.read()) is not None:
            self.last_heard = w.heard = time.monotonic()
            for msg in got:
                self._accept(w, msg)
        if link.eof and self._loop is not None:
            self._loop.remove_reader(link.sock.fileno())

    def _accept(self, w: Worker, msg: wire.Message) -> None:
        if isinstance(msg, wire.Arena):
            fd = w.link.fds.popleft()
            try:
                w.link.ledger.add_arena(fd, msg.slots, msg.slot_size)
            finally:
                os.close(fd)
        elif isinstance(msg, wire.Skipped):
            self.skips.add(SkippedLoad(msg.key, w.id, msg.attempts, msg.error))
        elif isinstance(msg, (wire.Batch, wire.PassEnd, wire.Rewound, wire.Retiring,
                              wire.Failed, wire.BatchFailed)):
            slot = msg.slot if isinstance(msg, (wire.Batch, wire.PassEnd, wire.BatchFailed)) \
                else None  # (an index batch's failure holds none)
            if slot is not None:
                w.link.ledger.published(slot)
            inbound: Inbound = msg if not isinstance(msg, (wire.Failed, wire.BatchFailed)) \
                else self._error(w, msg)
            action = self.roster.on_message(w, inbound)
            if action is not None:
                self._start_successor(action)
        # wire.Progress: hearing it (last_heard) is all it is for

    def _error(self, w: Worker, msg: wire.Failed | wire.BatchFailed) -> WorkerError | BatchFailure:
        """:func:`told_error`; a thread worker's original comes by reference, from its shelf."""
        original: object = None
        if isinstance(ledger := w.link.ledger, RefLedger):
            original = (ledger.shelf.error if isinstance(msg, wire.Failed)
                        else ledger.shelf.errors.pop(msg.seq, None))
        return told_error(self._named(w), msg, original, worker_id=w.id, pid=w.link.pid)

    def _on_exit(self, w: Worker) -> None:
        process = w.link.process
        try:
            assert self._loop is not None
            self._loop.remove_reader(process.sentinel)
            self._drain(w)  # a Failed message sent just before exiting comes first
            if self.roster.on_exit(w) and self._reaping.acquire(False):
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

    async def _take(self, w: Worker, msg: wire.Batch, lease: bool) -> Any:
        return await w.link.ledger.take(msg.slot, msg.nbytes, msg.tree, lease=lease)

    def _slot_read(self, w: Worker, slot: int) -> None:
        w.link.ledger.skip(slot)

    async def _wait(self, worker_id: int) -> None:
        assert self._loop is not None, "receive() outside an attached epoch"
        w = self.workers[worker_id]
        w.link.ledger.reclaim()
        if self.budget.room and self._can_kill() and (
                self._queued is None or self._queued[:2] != (worker_id, w.heard)):
            self._queued = (worker_id, w.heard, cpu_queued_ns(w.link.pid), time.monotonic())
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _starved(self, w: Worker) -> float:
        if self._queued is None or self._queued[:2] != (w.id, w.heard):
            return 0.0
        _, heard, before, since = self._queued
        now = cpu_queued_ns(w.link.pid)
        if before is None or now is None:
            return 0.0
        waited = max(0, now - before) / 1e9
        # Nothing was measured before the consumer began to wait; a worker starved for most
        # of the time since was most likely starved then too. A stopped or blocked one waits
        # for no CPU, and one stopped moments after the wait began waited for microseconds:
        # neither counts the unmeasured time (when any wait counted, some hangs were healed
        # one timeout late).
        if waited >= (time.monotonic() - since) / 2:
            return waited + max(0.0, since - heard)
        return waited

    def _can_kill(self) -> bool:
        return not self.spec.workers.threaded  # a hung thread times out

    def _kill(self, w: Worker, silence: float) -> bool:
        """SIGKILL ends a stopped process too; its exit then takes a crash's path."""
        if w.link.pid is None:
            return False
        log.warning("%s hung: no word for %.1f s (timeout=%s) while the consumer waited "
                    "for its batch; killing it (SIGKILL) to replace it", self._named(w),
                    w.silenced, silence)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.link.pid, signal.SIGKILL)
        return True

    # ------------------------------------------------------------------ send

    def _ask(self, w: Worker, seq: int, indices: list[int]) -> None:
        self._send_to(w, wire.Task(seq, indices))

    def _rewind(self, w: Worker, pass_no: int) -> None:
        self._send_to(w, wire.Rewind(pass_no))

    def _send_to(self, w: Worker, msg: wire.Message) -> None:
        if self.closed or not w.link.send(msg):
            return
        if self._loop is not None and w is self.workers[w.id]:  # else: watched later
            self._loop.add_writer(w.link.sock.fileno(), self._on_writable, w)

    def _on_writable(self, w: Worker) -> None:
        if w.link.flush() and self._loop is not None:
            self._loop.remove_writer(w.link.sock.fileno())

    # ------------------------------------------------------------------ stop

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        """Each worker's telemetry, and the arenas'; plain reads, no syscall."""
        now = list(self.workers)
        workers = tuple(worker_stats(w, w.link.pid if w.phase is not Phase.REAPED else None)
                        for w in now)
        usages = [w.link.ledger.usage() for w in now]
        return workers, ArenaStats(*(sum(getattr(u, f.name) for u in usages)
                                     for f in dataclasses.fields(ArenaStats)))

    def describe(self, worker_ids: list[int]) -> str:
        named = super().describe(worker_ids)
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
        """Stop every worker without blocking the loop: ``grace`` seconds to leave on EOF."""
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
            everyone = list(self._retired)
            starts: Starts = {}
            if not retired_only:
                unused, self._standbys = self._standbys, []  # a start that failed early
                for standby in unused:
                    standby.dismiss()
                    starts[standby.started] = standby.started_process
                everyone += self.workers
                everyone += [w.successor for w in self.workers if w.successor is not None]
            for w in everyone:  # a start in flight joins the schedule once its process exists
                if w.phase is not Phase.REAPED:
                    starts[w.link.launch.future] = w.link.launch.started_process
            stop_processes(grace, starts)
            for w in everyone:
                if w.link.launch.started:
                    w.phase = Phase.REAPED  # out of the loop's hands: retired, or closed
            self._retired = [w for w in self._retired if w.phase is not Phase.REAPED]
            if retired_only:
                return
            for w in everyone:
                w.link.ledger.close()
