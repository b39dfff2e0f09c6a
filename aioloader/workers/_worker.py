"""worker_main(spec, sock): the loop of one worker process, a plain function.

A worker reads (stream plan) or fetches (index plan) instances, batches and collates them
straight into a free slot of its arena, and sends a small header over its socket. It runs its
own event loop (uvloop when present) so that readers may be async generators. It stops when
its socket reaches EOF (the parent closed it, or died), and on Linux the kernel kills it if
the parent dies first (PR_SET_PDEATHSIG); a thread of its own ends it ORPHAN_GRACE seconds
after that EOF whatever its loop is stuck in (a forkserver's child outlives the consumer).

A thread worker (``worker_type="thread"``, aioloader/workers/_threads.py) serves the same
:func:`serve` on a loop in a thread of the main process, its batches going by reference
(a :class:`~aioloader.plane._dataplane.Shelf`); everything process-wide is left alone there:
signals, torch's thread count and collate map, the global RNGs, exiting.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import gc
import os
import pickle
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from .._config import Workers
from .._info import WorkerInfo, set_worker_info
from ..pipeline._loads import ALL_SKIPPED, SKIP_REPORT, LoadOptions, LoadStage, SkippedLoad
from ..pipeline._pipeline import BatchOptions, Boundary, InOrder, Pipeline, each
from ..pipeline._recycle import MEMORY
from ..pipeline._stacking import route_torch_collate_into_arena, use_allocator
from ..plane import _wire as wire
from ..plane._arena import ArenaMap, SlotFull, SlotWriter
from ..plane._codec import encode, tensors_nbytes
from ..plane._dataplane import RefPool, Shelf, SlotPool
from ..plans._position import Mark, ShardPosition
from ..plans._samplers import derive_seed
from ..plans._sources import Kind, Unhooked

Plan = Literal["stream", "instances", "index"]
PROGRESS_EVERY = 0.1  # seconds of reading without a message before a Progress is sent
_PROGRESS_FRAME = wire.encode(wire.Progress())


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; pickled as is for spawn and forkserver. ``workers`` is the
    loader's config part of that name, as it is (limits, slots, niceness, worker_init_fn)."""

    source: Any
    kind: Kind
    data_path: Any
    plan: Plan
    options: BatchOptions
    collate_fn: Callable[[list[Any]], Any] | None
    workers: Workers
    worker_id: int
    rank: int
    world_size: int
    seed: int
    first_pass: int
    parent_pid: int
    starts: tuple[ShardPosition, ...] | None = None  # per worker: where a resumed stream starts
    loads: LoadOptions | None = None  # the source yields keys; this stage loads them

    def parts(self) -> dict[str, Any]:
        """What spawn and forkserver pickle of the user's, by the names they were given."""
        return {"source": self.source, "collate_fn": self.collate_fn, "options": self.options,
                "worker_init_fn": self.workers.init_fn}

    def for_worker(self, worker_id: int) -> WorkerSpec:
        return replace(self, worker_id=worker_id)

    def starting_at(self, start: ShardPosition, num_workers: int) -> WorkerSpec:
        """This worker's spec, its stream starting at ``start`` (a restart)."""
        starts = list(self.starts or [ShardPosition(self.first_pass)] * num_workers)
        starts[self.worker_id] = start
        return replace(self, starts=tuple(starts))

    def start(self) -> ShardPosition:
        """Where this worker's stream starts (a resumed loader's position, issue 10)."""
        if self.starts is None:
            return ShardPosition(self.first_pass)
        return self.starts[self.worker_id]

    def seed_for(self, pass_no: int) -> int:
        return derive_seed(self.seed, pass_no, self.rank, self.worker_id) & ((1 << 63) - 1)

    def pipeline(self) -> Pipeline:
        """What this worker reads, and how it becomes batches."""
        return Pipeline(self.source, self.kind, self.data_path, self.options, self.collate_fn,
                        self.loads, self.worker_id, self.workers.num_workers, self.rank,
                        self.world_size)


class _Forking(threading.local):
    ours = False  # this thread is forking a worker (inside forking())
    gc_enabled = False  # the cyclic GC's state before that fork


_FORKING = _Forking()


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around ``Process.start()`` of a worker in this thread: a forked child never
    collects, so never finalizes, what it inherited (garbage included).

    A fork copies the parent's garbage too: a torch DataLoader iterator left in a reference
    cycle, collected by a worker's GC, ran its ``__del__`` there and filled stderr with
    "AssertionError: can only test a child process" (issue 19). The GC is off across the
    fork (so it cannot run in the child before the hook below) and the child freezes
    everything it inherited first thing; the parent collects its garbage itself. Exits
    skip the rest: ``os._exit`` after multiprocessing's ``_bootstrap``, whose finalizer
    registry was cleared at the fork, so no atexit handler or inherited finalizer runs.
    """
    _FORKING.ours = True
    try:
        yield
    finally:
        _FORKING.ours = False


def _gc_off_before_fork() -> None:
    if _FORKING.ours:
        _FORKING.gc_enabled = gc.isenabled()
        gc.disable()


def _gc_back_in_parent() -> None:
    if _FORKING.ours and _FORKING.gc_enabled:
        gc.enable()


def _freeze_inherited_in_child() -> None:
    if _FORKING.ours:  # the forking thread is the child's only one: its local came along
        _FORKING.ours = False
        gc.freeze()  # the inherited objects: never collected here, still shared pages
        if _FORKING.gc_enabled:
            gc.enable()  # for what the worker itself makes


os.register_at_fork(before=_gc_off_before_fork, after_in_parent=_gc_back_in_parent,
                    after_in_child=_freeze_inherited_in_child)


def worker_main(spec: WorkerSpec, sock: socket.socket) -> None:
    """Entry point of a worker process."""
    if spec.workers.nice:
        # Before any work: the consumer's process wins a core when workers fill them all.
        os.nice(spec.workers.nice)
    # A child forked after the parent used torch's intra-op pool can deadlock on its first
    # parallel op (pytorch#17199); torch's own workers do the same.
    torch.set_num_threads(1)
    route_torch_collate_into_arena()  # not a shared-memory segment per batch
    _detach_from_parent_signals(spec)
    _leave_when_parent_hangs_up(sock)
    from .. import _loops

    _loops.run(serve(spec, sock))


def _detach_from_parent_signals(spec: WorkerSpec) -> None:
    # Ctrl-C reaches the whole process group: the parent decides, workers must not die
    # half-way through a batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked child inherits the parent loop's wake-up fd: signals here would wake it.
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread of the child: nothing was inherited
        pass
    # Python 3.11 keeps the forking thread's running loop in the child (fixed in 3.12).
    asyncio.events._set_running_loop(None)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if spec.parent_pid and os.getppid() != spec.parent_pid and os.getppid() == 1:
        os._exit(0)  # the parent died before we got here
    _drop_forkserver_alive_fd()


def _drop_forkserver_alive_fd() -> None:
    """A forkserver's child holds the write end of the server's "alive" pipe
    (multiprocessing passes it to every child it forks), and the server exits only once no
    process holds it: a worker stuck in user code kept the server alive after the consumer
    died, and the server, whose death is what fires our PR_SET_PDEATHSIG, kept the worker
    alive (issue 19). A worker has no use for it: it does not know that server's address,
    so it could not start processes from it anyway."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if server.get_inherited_fds() is None or server._forkserver_alive_fd is None:
        return  # not a forkserver's child
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None


ORPHAN_GRACE = 2.0  # seconds a worker may take to go once its parent hung up, whatever it runs


def _leave_when_parent_hangs_up(sock: socket.socket) -> None:
    """End this process ORPHAN_GRACE seconds after the parent's end of ``sock`` closes,
    from a thread of its own: the event loop sees that EOF only between two pieces of user
    code, and a worker stuck in a slow ``__getitem__`` (or joining a thread stuck there as
    it exits) would outlive a parent that died, with nobody left to kill it (issue 19; for
    forkserver, PR_SET_PDEATHSIG fires on the server's death, not the consumer's). A live
    parent kills a slow worker itself sooner (GRACE, then SIGTERM: see _supervisor)."""
    rdhup = getattr(select, "POLLRDHUP", None)
    if rdhup is None or not hasattr(select, "poll"):
        return  # not Linux: the parent's escalation is all there is
    fd = os.dup(sock.fileno())  # the watcher's own: the worker closes ``sock`` as it ends

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, rdhup)  # hang-ups only (and errors): never data
        poller.poll()
        threading.Event().wait(ORPHAN_GRACE)  # a deadline, not a poll: we exit at its end
        os._exit(0)

    threading.Thread(target=watch, name="aioloader-parent-watch", daemon=True).start()


class _Channel:
    """The worker's end of its socket: commands in, framed messages out, arena slots."""

    def __init__(self, spec: WorkerSpec, sock: socket.socket, shelf: Shelf | None) -> None:
        self.spec = spec
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.frames = wire.FrameReader()
        self.shelf = shelf
        self.pool = (SlotPool(spec.workers.slots, f"aioloader-w{spec.worker_id}") if shelf is None
                     else RefPool(spec.workers.slots, shelf))
        self.tasks: collections.deque[wire.Task] = collections.deque()
        self.eof = False
        self.last_sent = self.started = time.monotonic()
        self.idle = 0.0  # seconds spent waiting for a slot or a task (telemetry: busy share)
        self._waiters: list[asyncio.Future[None]] = []  # a load stage has several
        self.on_eof: Callable[[], object] | None = None
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._on_readable)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.pool.close()

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
            self.loop.remove_reader(self.sock.fileno())
            if self.on_eof is not None:
                self.on_eof()
        else:
            for msg in self.frames.feed(data):
                if isinstance(msg, wire.Release):
                    self.pool.returned(msg.slot)
                elif isinstance(msg, wire.Task):
                    self.tasks.append(msg)
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _until(self, ready: Callable[[], bool]) -> bool:
        """Wait for ``ready()``; False when the parent went away first."""
        if ready():
            return True
        began = time.monotonic()
        try:
            while not ready():
                if self.eof:
                    return False
                fut = self.loop.create_future()
                self._waiters.append(fut)
                await fut
            return True
        finally:
            self.idle += time.monotonic() - began

    async def slot(self) -> int | None:
        if not await self._until(lambda: bool(self.pool.free)):
            return None
        return self.pool.reserve()

    async def task(self) -> wire.Task | None:
        if not await self._until(lambda: bool(self.tasks)):
            return None
        return self.tasks.popleft()

    async def send(self, msg: wire.Message, fds: list[int] | None = None) -> None:
        frame = wire.encode(msg)
        self.last_sent = time.monotonic()
        if not fds:
            await self.loop.sock_sendall(self.sock, frame)
            return
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            try:
                sent = self.sock.sendmsg([frame], ancillary)
                break
            except (BlockingIOError, InterruptedError):
                await self._writable()
        if sent < len(frame):
            await self.loop.sock_sendall(self.sock, frame[sent:])

    def progress(self) -> None:
        """Say "still reading" when nothing went out for a while: the parent's timeout
        measures silence, and a slow reader that keeps producing is not silent.

        Called between instances, when no send is in flight; a full socket skips it.
        """
        now = time.monotonic()
        if now - self.last_sent < PROGRESS_EVERY:
            return
        self.last_sent = now
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            self.sock.send(_PROGRESS_FRAME)

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(fd, ready)
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)

    async def emit(self, seq: int, make: Callable[[], Any],
                   mark: Mark | str | None = None) -> bool:
        """Build one message body in a free slot with ``make()`` and send it.

        The collate writes straight into the slot (its allocator); whatever it made
        elsewhere is copied in by the encoder. A batch larger than a slot grows the arena.
        """
        slot = await self.slot()
        if slot is None:
            return False
        try:
            return await self._fill(slot, seq, make, mark)
        except BaseException:
            self.pool.free.appendleft(slot)  # never published: it is still ours
            raise

    async def _fill(self, slot: int, seq: int, make: Callable[[], Any],
                    mark: Mark | str | None) -> bool:
        pool = self.pool
        if isinstance(pool, RefPool):  # a thread worker: the batch itself, by reference
            with use_allocator(MEMORY):  # memory that batches dropped before left warm
                payload = make()
            pool.put(slot, payload)
            busy = time.monotonic() - self.started - self.idle
            await self.send(wire.Batch(slot, seq, tensors_nbytes(payload), None, mark, busy))
            return True
        if pool.arena is None:
            payload = make()  # the first batch tells how large a slot must be
            slot = await self._grow(tensors_nbytes(payload), slot)
            writer = SlotWriter(self._arena(), slot)
        else:
            writer = SlotWriter(pool.arena, slot)
            with use_allocator(writer.alloc):
                payload = make()
            if writer.overflow:
                slot = await self._grow(writer.pos - writer.start + writer.overflow, slot)
                writer = SlotWriter(self._arena(), slot)
        try:
            tree = encode(payload, writer)
        except SlotFull as full:
            slot = await self._grow(full.needed, slot)
            writer = SlotWriter(self._arena(), slot)
            tree = encode(payload, writer)
        nbytes = writer.pos - writer.start
        busy = time.monotonic() - self.started - self.idle
        await self.send(wire.Batch(slot, seq, nbytes, tree, mark, busy))
        return True

    def _arena(self) -> ArenaMap:
        assert self.pool.arena is not None
        return self.pool.arena

    async def _grow(self, needed: int, holding: int) -> int:
        """Make sure a slot holds ``needed`` bytes; the slot to write the batch in."""
        if self.pool.fits(needed):
            return holding
        grown = self.pool.grow(needed, holding)
        try:
            await self.send(wire.Arena(self.spec.workers.slots, grown.slot_size), fds=[grown.fd])
        finally:
            os.close(grown.fd)
        return grown.slot


class _ParentGone(Exception):
    """The socket reached EOF: the parent closed it or died."""


async def serve(spec: WorkerSpec, sock: socket.socket, shelf: Shelf | None = None) -> int:
    """Serve the parent on ``sock`` until EOF; the exit code (a process exits with it).

    ``shelf``: a thread worker's, for its batches and its exception, by reference.
    """
    chan = _Channel(spec, sock, shelf)
    info = WorkerInfo(spec.workers.num_workers, spec.worker_id, spec.seed_for(spec.first_pass),
                      spec.rank, spec.world_size)
    set_worker_info(info, dataset=spec.source, thread=spec.workers.threaded)
    if not spec.workers.threaded:  # a thread would reseed the user's own process
        seed_everything(info.seed)
    try:
        if spec.workers.init_fn is not None:
            # As torch: after the seeds and worker info, before any data is read; in every
            # process that serves the spec (a restarted or recycled worker's too). Its
            # exception is the worker's, reported like any other.
            spec.workers.init_fn(spec.worker_id)
        pipe = spec.pipeline()
        async with contextlib.AsyncExitStack() as stack:
            stage = None
            if spec.loads is not None or spec.workers.threaded:
                # Loads in flight (or a thread's async reader) wait on the network, not on
                # us: EOF (a close) cancels them at once, rather than after the parent's
                # grace period, past which a thread could only be cancelled anyway.
                serving = asyncio.current_task()
                assert serving is not None
                chan.on_eof = serving.cancel
            def report(s: SkippedLoad) -> Awaitable[None]:
                return chan.send(wire.Skipped(_plain(s.key), s.attempts, s.error))

            made = pipe.stage(spec.worker_id, report=report)
            if made is not None:
                stage = await stack.enter_async_context(made)
            SKIP_REPORT.set(report)  # a reader's own skips too (this task's context)
            if spec.plan == "index":
                await _run_index(spec, pipe, chan, stage)
            else:
                await _run_stream(spec, pipe, chan, stage)
    except _ParentGone:
        pass
    except asyncio.CancelledError:
        if not chan.eof:
            raise
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then we exit
        if chan.eof:
            return 0
        await _report(chan, exc, shelf)
        if shelf is not None:
            return 1  # a thread ends; only its process may exit
        chan.close()
        sock.close()
        os._exit(1)
    finally:
        chan.close()
        sock.close()
    return 0


async def _report(chan: _Channel, exc: BaseException, shelf: Shelf | None) -> None:
    with contextlib.suppress(OSError):
        await chan.send(wire.Failed(*_described(exc, shelf)))


def _described(exc: BaseException, shelf: Shelf | None,
               seq: int | None = None) -> tuple[str, str, bytes | None]:
    """``exc`` as the wire carries it: its repr, its traceback, and itself pickled; a
    thread worker's parent is in this process and takes the exception itself from
    ``shelf`` (by batch ``seq``, or as the worker's own)."""
    pickled: bytes | None = None
    if shelf is None:
        pickled = pickled_error(exc)
    elif seq is None:
        shelf.error = exc
    else:
        shelf.errors[seq] = exc
    return repr(exc), traceback_text(exc), pickled


def pickled_error(exc: BaseException) -> bytes | None:
    """``exc`` pickled, if it survives the round trip (None: the parent gets its text)."""
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - the traceback text still reaches the parent
        return None
    return pickled


def traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def seed_everything(seed: int) -> None:
    """A worker's global RNGs (Python's, torch's, numpy's) seeded for its worker and pass;
    a Ray actor's process is ours too, so it is seeded the same way."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:
        pass


def _collated(pipe: Pipeline, items: list[Any],
              indices: list[Any] | None = None) -> Callable[[], Any]:
    return lambda: pipe.collate(items, indices)


def _plain(key: Any) -> Any:
    """A key as the wire carries it: itself when it is plain data, else its repr."""
    return key if isinstance(key, (str, int, float, bool, bytes, type(None))) else repr(key)


class _Retirement:
    """When this worker should hand its work to a successor: after ``max_batches`` batches,
    or once its resident memory passes ``max_rss`` (a big forked dataset's pages turn
    private as Python's refcounts touch them: torch issue 13246)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.max_batches = spec.workers.max_batches
        self.max_rss = spec.workers.max_rss
        self.batches = 0

    def batch_done(self) -> bool:
        """Count a batch; True when the worker should retire now."""
        self.batches += 1
        if self.max_batches is not None and self.batches >= self.max_batches:
            return True
        # One read of smaps_rollup a batch: ~0.1-1 ms, against a batch of real work.
        return self.max_rss is not None and own_memory() > self.max_rss


def own_memory() -> int:
    """Bytes of memory this process holds alone: its private pages (USS).

    Not the RSS, which counts the pages a forked worker still shares with its parent: a
    worker's RSS starts as large as the parent's. Copy-on-access growth is private pages.
    """
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:  # not Linux: the peak RSS is the best there is
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total = 0
    for line in text.splitlines():
        if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


async def _run_stream(spec: WorkerSpec, pipe: Pipeline, chan: _Channel,
                      stage: LoadStage | None) -> None:
    """Passes over this worker's shard, one after the other, until the parent stops us."""
    start = spec.start()
    pass_no = start.pass_no
    retire = _Retirement(spec)
    seeded = spec.seed_for(spec.first_pass)  # by _serve, before worker_init_fn ran
    touch = chan.progress if spec.workers.progress else None
    while True:
        seed = spec.seed_for(pass_no)
        threaded = spec.workers.threaded
        set_worker_info(WorkerInfo(spec.workers.num_workers, spec.worker_id, seed, spec.rank,
                                   spec.world_size), dataset=spec.source, thread=threaded)
        if seed != seeded and not threaded:  # not again: worker_init_fn's seeding stays
            seed_everything(seed)
        seeded = -1
        sent = 0
        due = False
        if spec.plan == "instances":
            sent = await _send_instances(chan, pipe.chunks(start.start, stage, touch=touch))
        else:
            async with contextlib.aclosing(each(pipe.batches(start, seed, stage,
                                                             touch=touch))) as steps:
                async for step in steps:
                    if isinstance(step, Boundary):
                        if due:  # retiring, at a block boundary: the successor starts here
                            await _hand_over(chan, ShardPosition(
                                pass_no, step.start, frontier=start.frontier))
                            return
                        continue
                    if not await chan.emit(sent, _collated(pipe, step.items), step.mark):
                        return
                    sent += 1
                    due = retire.batch_done() or due
        slot = await chan.slot()  # a pass end takes a slot too: bounded, even when empty
        if slot is None:
            return
        await chan.send(wire.PassEnd(slot, pass_no, sent))
        if spec.plan == "instances":
            await chan._until(lambda: False)  # one pass only: wait for the parent to close
            return
        pass_no += 1
        start = ShardPosition(pass_no)
        if due:
            await _hand_over(chan, start)
            return


async def _hand_over(chan: _Channel, position: ShardPosition | None) -> None:
    """Retire: say where a successor takes over, then wait for the parent to close us."""
    await chan.send(wire.Retiring(position.to_data() if position is not None else None))
    await chan._until(lambda: False)


async def _send_instances(chan: _Channel,
                          chunks: Iterable[list[Any]] | Unhooked[list[Any]]) -> int:
    """One pass of instances, in chunks (a cache fills from them); a key skipped on error
    goes as its SkippedLoad marker, so that the parent's count of keys stays right."""
    sent = 0
    async with contextlib.aclosing(each(chunks)) as it:
        async for chunk in it:
            if not await chan.emit(sent, _given(chunk)):
                raise _ParentGone
            sent += 1
    return sent


def _given(value: Any) -> Callable[[], Any]:
    return lambda: value


async def _run_index(spec: WorkerSpec, pipe: Pipeline, chan: _Channel,
                     stage: LoadStage | None) -> None:
    """Fetch and collate the index batches the parent sends, in the order it sends them.

    A retiring worker says so and answers no more tasks: the parent gives the ones it did
    not answer to its successor, and closes this one once its batches are taken.
    """
    if stage is not None:
        await _run_index_loaded(spec, pipe, chan, stage)
        return
    retire = _Retirement(spec)
    touch = chan.progress if spec.workers.progress else None
    while True:
        task = await chan.task()
        if task is None:
            return
        try:
            items = pipe.fetch(task.indices, touch)
            sent = await chan.emit(task.seq, _collated(pipe, items, task.indices))
        except Exception as exc:  # noqa: BLE001 - that batch's error; the next task follows
            await chan.send(wire.BatchFailed(task.seq, *_described(exc, chan.shelf, task.seq)))
            continue
        if not sent:
            return
        if retire.batch_done():
            await _hand_over(chan, None)
            return


async def _tasks(chan: _Channel) -> AsyncIterator[wire.Task]:
    """The parent's tasks, as they arrive, until it goes away."""
    while (task := await chan.task()) is not None:
        yield task


async def _run_index_loaded(spec: WorkerSpec, pipe: Pipeline, chan: _Channel,
                            stage: LoadStage) -> None:
    """:func:`_run_index` with a load stage: every task the parent sent starts its loads at
    once (the stage's gate bounds them), so loads overlap across batches; batches still go
    out in the order of the tasks."""
    retire = _Retirement(spec)
    fetches = InOrder(_tasks(chan), lambda task: stage.fetch(spec.source, task.indices))
    try:
        async for task, group in fetches:
            # Every key of the batch skipped: an empty answer, which the parent passes over.
            make = _collated(pipe, group) if group else _given(None)
            if not await chan.emit(task.seq, make, None if group else ALL_SKIPPED):
                return
            if retire.batch_done():
                await _hand_over(chan, None)
                return
    finally:
        await fetches.aclose()
