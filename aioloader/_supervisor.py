"""Owns the worker processes of one session: start, watch (socket + sentinel), stop, reap.

The parent side of every worker is one non-blocking socket whose fd the running event loop
watches with ``add_reader``, plus the process sentinel, watched the same way, so that a
worker that dies without a word is noticed at once. No threads, no polling: the loop wakes
on bytes, on EOF and on process exit. Readers are attached only while an epoch runs, so a
session can outlive one event loop and serve the next (the sync adapter runs its own).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing

from . import _wire as wire
from ._arena import ArenaMap, Lease
from ._codec import copied_from, decode
from ._errors import SourcePicklingError, WorkerDied, WorkerError
from ._worker import WorkerSpec, worker_main

# Processes are started from one long-lived thread: starting can block (spawn writes the
# pickled spec into a pipe the child reads only once Python is up), and the thread that
# forks a child is the "parent" PR_SET_PDEATHSIG watches, so it must outlive the workers.
_STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioloader-start")

# Parent-side sockets of every live worker. A process forked later (another worker) must
# not hold them open, or a worker would never see EOF when its parent closes or dies.
_PARENT_FDS: set[int] = set()


def _close_parent_fds_in_child() -> None:
    for fd in list(_PARENT_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _PARENT_FDS.clear()


os.register_at_fork(after_in_child=_close_parent_fds_in_child)

COPY_IN_THREAD_BYTES = 1 << 20
LEASE_MIN_BYTES = 256 << 10  # below, a copy costs less than a lease's bookkeeping
GRACE = 1.0  # seconds a worker gets to exit on EOF before SIGTERM, then as long to SIGKILL


@dataclass(eq=False)
class WorkerState:
    """The parent's view of one worker."""

    id: int
    process: BaseProcess
    sock: socket.socket
    frames: wire.FrameReader = field(default_factory=wire.FrameReader)
    inbox: collections.deque[wire.Message] = field(default_factory=collections.deque)
    fds: collections.deque[int] = field(default_factory=collections.deque)
    arenas: dict[int, ArenaMap] = field(default_factory=dict)  # by generation
    generation: int = -1  # the newest
    unreleased: collections.Counter[int] = field(default_factory=collections.Counter)
    outbox: bytearray = field(default_factory=bytearray)
    eof: bool = False
    exited: bool = False
    started: bool = False
    reaped: bool = False
    leased: int = 0  # slots whose batch the consumer still holds
    returned: collections.deque[int] = field(default_factory=collections.deque)  # any thread

    @property
    def pid(self) -> int | None:
        return self.process.pid


class Supervisor:
    """Starts ``num_workers`` processes for ``spec`` and moves messages to and from them."""

    def __init__(self, spec: WorkerSpec, num_workers: int, start_method: str) -> None:
        self.spec = spec
        self.num_workers = num_workers
        self.start_method = start_method
        self.workers: list[WorkerState] = []
        self.failure: WorkerError | None = None
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reaping = threading.Lock()

    # ------------------------------------------------------------------ start

    def check_picklable(self) -> None:
        """With spawn/forkserver the spec travels pickled: fail before starting anything."""
        if self.start_method == "fork":
            return
        from multiprocessing.reduction import ForkingPickler

        for name in ("source", "collate_fn", "options"):
            value = getattr(self.spec, name)
            try:
                ForkingPickler.dumps(value)
            except Exception as exc:
                raise SourcePicklingError(
                    f"the {name} ({type(value).__name__}) cannot be pickled, which "
                    f"start_method={self.start_method!r} needs to send it to the workers: "
                    f"{exc!r}. Make it picklable (no lambdas, locks or open files as "
                    "attributes; define classes at module level) or use start_method='fork'."
                ) from exc

    async def start(self) -> None:
        self.check_picklable()
        ctx: Any = torch.multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The server imports torch and aioloader once; each worker forks from it warm.
            ctx.set_forkserver_preload(["aioloader._worker"])
        loop = asyncio.get_running_loop()
        try:
            for k in range(self.num_workers):
                parent, child = socket.socketpair()
                _PARENT_FDS.add(parent.fileno())
                proc = ctx.Process(target=worker_main, args=(self.spec.for_worker(k), child),
                                   daemon=True, name=f"aioloader-worker-{k}")
                self.workers.append(WorkerState(k, proc, parent))
                state = self.workers[-1]
                try:
                    await loop.run_in_executor(_STARTER, proc.start)
                    state.started = True
                finally:
                    child.close()
                parent.setblocking(False)
        except BaseException:
            await self.aclose()
            raise

    # ------------------------------------------------------------------ watch

    def attach(self) -> None:
        """Watch every worker's socket and sentinel on the running loop."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        for w in self.workers:
            if not w.eof:
                loop.add_reader(w.sock.fileno(), self._on_readable, w)
            if not w.exited:
                loop.add_reader(w.process.sentinel, self._on_exit, w)
            if w.outbox:
                loop.add_writer(w.sock.fileno(), self._on_writable, w)

    def detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        for w in self.workers:
            if w.sock.fileno() >= 0:
                loop.remove_reader(w.sock.fileno())
                loop.remove_writer(w.sock.fileno())
            loop.remove_reader(w.process.sentinel)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_readable(self, w: WorkerState) -> None:
        self._drain(w)
        self._wake()

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
            for msg in w.frames.feed(data):
                self._accept(w, msg)

    def _accept(self, w: WorkerState, msg: wire.Message) -> None:
        if isinstance(msg, wire.Arena):
            fd = w.fds.popleft()
            try:
                w.generation += 1
                w.arenas[w.generation] = ArenaMap(fd, msg.slots, msg.slot_size)
            finally:
                os.close(fd)
            self._retire(w, w.generation - 1)
        elif isinstance(msg, wire.Failed):
            if self.failure is None:
                self.failure = _worker_error(w, msg)
        else:
            if isinstance(msg, (wire.Batch, wire.PassEnd)):
                w.unreleased[msg.slot // self.spec.slots] += 1
            w.inbox.append(msg)

    def release(self, worker_id: int, slot: int) -> None:
        """Give ``slot`` back to its worker; unmap a retired arena once nothing is in it."""
        w = self.workers[worker_id]
        generation = slot // self.spec.slots
        w.unreleased[generation] -= 1
        self.send(worker_id, wire.Release(slot))
        self._retire(w, generation)

    def _retire(self, w: WorkerState, generation: int) -> None:
        if generation < w.generation and w.unreleased[generation] <= 0:
            arena = w.arenas.pop(generation, None)
            if arena is not None:
                arena.close()

    def _on_exit(self, w: WorkerState) -> None:
        assert self._loop is not None
        self._loop.remove_reader(w.process.sentinel)
        w.exited = True
        self._drain(w)  # a Failed message sent just before exiting comes first
        if self.failure is None and not self.closed:
            w.process.join(GRACE)
            self.failure = WorkerDied(w.id, w.pid, w.process.exitcode)
        self._wake()

    async def receive(self, worker_id: int) -> wire.Message:
        """The next message of worker ``worker_id``; raises the session's first failure."""
        w = self.workers[worker_id]
        self._take_back_leases()
        while True:
            if self.failure is not None:
                raise self.failure
            if w.inbox:
                return w.inbox.popleft()
            assert self._loop is not None, "receive() outside an attached epoch"
            self._waiter = self._loop.create_future()
            await self._waiter

    async def take(self, worker_id: int, msg: wire.Batch, *, lease: bool = True) -> Any:
        """The batch in ``msg``, the consumer's own: leased, or copied out of its slot.

        A large batch is leased: its tensors are views of the slot, which goes back to the
        worker once they are garbage-collected, so nothing is copied. A worker always keeps
        one slot that is not leased, so a consumer that hoards batches slows the loader
        down to copying (each slot back at once) but never stalls it. A small batch, or one
        past that limit, is copied; a large copy runs in a thread (``copy_`` releases the
        GIL), so that the loop keeps running meanwhile. ``lease=False`` always copies (for
        what is kept for long, like a cache of instances).
        """
        w = self.workers[worker_id]
        self._take_back_leases()
        arena = w.arenas.get(msg.slot // self.spec.slots)
        if lease and msg.nbytes >= LEASE_MIN_BYTES and w.leased < self.spec.slots - 1 and arena:
            w.leased += 1
            views = Lease(arena, msg.slot, functools.partial(w.returned.append, msg.slot))
            return decode(msg.tree, views.view)
        try:
            if msg.nbytes >= COPY_IN_THREAD_BYTES:
                return await asyncio.to_thread(decode, msg.tree, copied_from(arena))
            return decode(msg.tree, copied_from(arena))
        finally:
            self.release(worker_id, msg.slot)

    def _take_back_leases(self) -> None:
        """Give the workers back the slots whose leased batches were garbage-collected."""
        for w in self.workers:
            while w.returned:
                slot = w.returned.popleft()
                w.leased -= 1
                self.release(w.id, slot)

    # ------------------------------------------------------------------ send

    def send(self, worker_id: int, msg: wire.Message) -> None:
        w = self.workers[worker_id]
        if w.eof or self.closed:
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
            if self._loop is not None:
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

    def describe(self, worker_ids: list[int]) -> str:
        return ", ".join(f"worker {k} (pid {self.workers[k].pid})" for k in worker_ids)

    async def aclose(self, grace: float = GRACE) -> None:
        """Stop every worker and wait for it, without blocking the loop.

        ``grace``: how long a worker may take to leave on EOF before it is terminated (an
        error path passes 0: nothing is waiting for that worker's last words).
        """
        if not self._begin_close():
            return
        reaped = asyncio.get_running_loop().run_in_executor(None, self._reap, grace)
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

    def kill(self) -> None:
        """The garbage collector's backstop: no grace, no waiting beyond the reaping."""
        if self._begin_close():
            self._reap(0.0)

    def _begin_close(self) -> bool:
        if self.closed:
            return False
        self.closed = True
        self.detach()
        for w in self.workers:
            _PARENT_FDS.discard(w.sock.fileno())
            w.sock.close()  # EOF: the worker's signal to stop
            while w.fds:
                os.close(w.fds.popleft())
        return True

    def _reap(self, grace: float) -> None:
        with self._reaping:  # the executor's thread and a cancelled caller may both get here
            self._reap_locked(grace)

    def _reap_locked(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        started = [w for w in self.workers if w.started and not w.reaped]
        for w in started:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for escalate in (BaseProcess.terminate, BaseProcess.kill):
            alive = [w for w in started if w.process.exitcode is None]
            if not alive:
                break
            for w in alive:
                escalate(w.process)
            deadline = time.monotonic() + GRACE
            for w in alive:
                w.process.join(max(0.0, deadline - time.monotonic()))
        for w in started:
            w.process.join()
            w.process.close()
            w.reaped = True
        for w in self.workers:
            for arena in w.arenas.values():
                arena.close()  # leased views keep their mapping: it goes with the last one
            w.arenas.clear()


def _worker_error(w: WorkerState, msg: wire.Failed) -> WorkerError:
    err = WorkerError(
        f"worker {w.id} (pid {w.pid}) raised {msg.error_repr}\n\n"
        "  Traceback from the worker:\n  " + msg.traceback.rstrip().replace("\n", "\n  "),
        worker_id=w.id, pid=w.pid)
    if msg.pickled is not None:
        with contextlib.suppress(Exception):
            err.__cause__ = pickle.loads(msg.pickled)
    return err
