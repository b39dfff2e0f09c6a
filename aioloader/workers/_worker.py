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

import asyncio
import contextlib
import gc
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import torch

from ..pipeline._loads import SKIP_REPORT, LoadStage, SkippedLoad
from ..pipeline._pipeline import Batch, InOrder
from ..pipeline._stacking import route_torch_collate_into_arena
from ..plane import _wire as wire
from ..plane._dataplane import Shelf
from ..plans._position import ShardPosition
from ._channel import Channel
from ._failures import described
from ._passes import Build, Event, PassEnd, Serving, serving
from ._spec import WorkerSpec


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


async def serve(spec: WorkerSpec, sock: socket.socket, shelf: Shelf | None = None) -> int:
    """Serve the parent on ``sock`` until EOF; the exit code (a process exits with it).

    ``shelf``: a thread worker's, for its batches and its exception, by reference.
    """
    chan = Channel(spec.workers.slots, f"aioloader-w{spec.worker_id}", sock, shelf)
    if spec.loads is not None or spec.workers.threaded:
        # Loads in flight (or a thread's async reader) wait on the network, not on us: EOF
        # (a close) cancels them at once, rather than after the parent's grace period,
        # past which a thread could only be cancelled anyway.
        serving_task = asyncio.current_task()
        assert serving_task is not None
        chan.on_eof = serving_task.cancel

    def report(s: SkippedLoad) -> Awaitable[None]:
        return chan.send(wire.Skipped(_plain(s.key), s.attempts, s.error))

    code = 0
    try:
        async with serving(spec, report) as worker:
            SKIP_REPORT.set(report)  # a reader's own skips too (this task's context)
            if spec.plan == "index":
                await _run_index(worker, chan)
            else:
                await _run_stream(worker, chan)
    except asyncio.CancelledError:
        if not chan.eof:
            raise
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then we exit
        if not chan.eof:  # after EOF, nobody is left to tell: a plain end
            with contextlib.suppress(OSError):
                await chan.send(wire.Failed(*described(exc, shelf)))
            code = 1
    finally:
        chan.close()
        sock.close()
    if code and shelf is None:
        os._exit(code)  # a process: its parent has the exception; nothing else runs here
    return code  # a thread ends; only its process may exit


def _plain(key: Any) -> Any:
    """A key as the wire carries it: itself when it is plain data, else its repr."""
    return key if isinstance(key, (str, int, float, bool, bytes, type(None))) else repr(key)


async def _run_stream(worker: Serving, chan: Channel) -> None:
    """The worker's passes (:func:`~aioloader.workers._passes.passes`) over the wire, until
    the parent stops us. A :class:`~aioloader.plane._wire.Rewind` drops the pass under way
    (its iterator closed) and starts the one asked for, as torch's persistent worker calls
    ``iter(dataset)`` again for a new epoch: the worker and what it set up stay."""
    touch = chan.progress if worker.spec.workers.progress else None
    start = worker.spec.start()
    while True:
        async with contextlib.aclosing(worker.passes(touch, start)) as events:
            said_all = await _send_passes(worker, chan, events)
        if said_all or chan.rewind is None:
            break
        pass_no, chan.rewind = chan.rewind, None
        await chan.send(wire.Rewound(pass_no))
        start = ShardPosition(pass_no)
    await chan.closed()  # a hand-over, or instances' one pass: the parent closes us


async def _send_passes(worker: Serving, chan: Channel,
                       events: AsyncIterator[Event[Any]]) -> bool:
    """Send ``events``: each batch built into a slot, each pass end in a slot of its own
    (bounded, even when the pass was empty), a hand-over as the successor's position. True
    once they said all (a hand-over, instances' one pass); False when the parent went away
    or asked for a rewind (the rest belongs to the pass dropped)."""
    async for event in events:
        chan.poll()
        if chan.rewind is not None:
            return False
        if isinstance(event, Build):
            if not await _emit_built(worker, chan, event):
                return False
        elif isinstance(event, PassEnd):
            slot = await chan.slot()
            if slot is None:
                return False
            await chan.send(wire.PassEnd(slot, event.pass_no, event.batches))
        else:
            await chan.send(wire.Retiring(event.position.to_data()))
    return True


async def _emit_built(worker: Serving, chan: Channel, event: Build[Any]) -> bool:
    """Send one batch of the stream (or chunk of instances); False once the parent is gone.

    A batch whose making raised (the source's error, or the collate's) is that batch's
    error, in a slot of its own as the batch would be, and the stream goes on, as torch's
    IterableDataset worker sends the exception in the batch's place and goes on (issue 32).
    A chunk of instances (a cache) has no batch to fail: its error ends the worker.
    """
    make, mark = worker.making(event.batch)
    if not isinstance(event.batch, Batch):
        return await chan.emit(event.seq, make, mark)
    try:
        return await chan.emit(event.seq, make, mark)
    except Exception as exc:  # noqa: BLE001 - that batch's error; the stream goes on
        slot = await chan.slot()
        if slot is None:
            return False
        await chan.send(wire.BatchFailed(event.seq, *described(exc, chan.shelf, event.seq),
                                         slot, mark))
        return True


async def _run_index(worker: Serving, chan: Channel) -> None:
    """Fetch and collate the index batches the parent sends, in the order it sends them.

    A retiring worker says so and answers no more tasks: the parent gives the ones it did
    not answer to its successor, and closes this one once its batches are taken.
    """
    if worker.stage is not None:
        await _run_index_loaded(worker, chan, worker.stage)
        return
    pipe = worker.pipe
    retire = worker.retirement
    touch = chan.progress if worker.spec.workers.progress else None
    while True:
        task = await chan.task()
        if task is None:
            return
        try:
            items = pipe.fetch(task.indices, touch)
            sent = await chan.emit(task.seq, *worker.answering(items, task.indices))
        except Exception as exc:  # noqa: BLE001 - that batch's error; the next task follows
            await chan.send(wire.BatchFailed(task.seq, *described(exc, chan.shelf, task.seq)))
            continue
        if not sent:
            return
        if retire.batch_done():
            await _retire(chan)
            return


async def _retire(chan: Channel) -> None:
    """An index worker retires: the parent gives its unanswered tasks to a successor."""
    await chan.send(wire.Retiring(None))
    await chan.closed()


async def _tasks(chan: Channel) -> AsyncIterator[wire.Task]:
    """The parent's tasks, as they arrive, until it goes away."""
    while (task := await chan.task()) is not None:
        yield task


async def _run_index_loaded(worker: Serving, chan: Channel, stage: LoadStage) -> None:
    """:func:`_run_index` with a load stage: every task the parent sent starts its loads at
    once (the stage's gate bounds them), so loads overlap across batches; batches still go
    out in the order of the tasks."""
    source = worker.spec.source
    retire = worker.retirement
    fetches = InOrder(_tasks(chan), lambda task: stage.fetch(source, task.indices))
    try:
        async for task, group in fetches:
            if not await chan.emit(task.seq, *worker.answering(group)):
                return
            if retire.batch_done():
                await _retire(chan)
                return
    finally:
        await fetches.aclose()
