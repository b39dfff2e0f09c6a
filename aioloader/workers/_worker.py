"""worker_main(spec, sock): the loop of one worker process, a plain function.

A thread worker serves the same :func:`serve`, and leaves everything process-wide alone."""

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

from ..pipeline._loads import SKIP_REPORT, SkippedLoad
from ..pipeline._pipeline import InOrder
from ..pipeline._stacking import route_torch_collate_into_arena
from ..plane import _wire as wire
from ..plane._dataplane import Shelf
from ..plans._position import ShardPosition
from ._channel import Channel
from ._failures import described
from ._passes import Build, Event, PassEnd, Serving, answer, build, serving
from ._spec import WorkerSpec


class _Forking(threading.local):
    ours = False  # this thread is forking a worker (inside forking())
    gc_enabled = False  # the cyclic GC's state before that fork


_FORKING = _Forking()


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around ``Process.start()`` of a worker in this thread: a forked child never collects,
    so never finalizes, what it inherited (docs/architecture.md, issue 19)."""
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
    # A forked child inherits the parent loop's wake-up fd: signals here would wake it (not
    # the main thread of the child: nothing was inherited).
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    # Python 3.11 keeps the forking thread's running loop in the child (fixed in 3.12).
    asyncio.events._set_running_loop(None)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if spec.parent_pid and os.getppid() != spec.parent_pid and os.getppid() == 1:
        os._exit(0)  # the parent died before we got here
    _drop_forkserver_alive_fd()


def _drop_forkserver_alive_fd() -> None:
    """Close the forkserver's "alive" pipe this child inherited: it kept the server, and so
    the worker, alive after the consumer died (docs/architecture.md, issue 19)."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if server.get_inherited_fds() is None or server._forkserver_alive_fd is None:
        return  # not a forkserver's child
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None


ORPHAN_GRACE = 2.0  # seconds a worker may take to go once its parent hung up, whatever it runs


def _leave_when_parent_hangs_up(sock: socket.socket) -> None:
    """End this process ORPHAN_GRACE seconds after the parent's end of ``sock`` closes, from
    a thread of its own, whatever its loop is stuck in (docs/architecture.md, issue 19)."""
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
    """Serve the parent on ``sock`` until EOF; the exit code (``shelf``: a thread's)."""
    chan = Channel(spec.workers.slots, f"aioloader-w{spec.worker_id}", sock, shelf,
                   stream=spec.plan != "index")
    if spec.loads is not None or spec.workers.threaded:
        # Loads in flight (or a thread's async reader) wait on the network, not on us: EOF
        # cancels them at once, rather than after the parent's grace period.
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
    """The worker's passes over the wire, until the parent stops us. A
    :class:`~aioloader.plane._wire.Rewind` drops the pass under way and starts the one asked
    for, as torch's persistent worker calls ``iter(dataset)`` again: the set-up stays."""
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
    """Send ``events``, each batch and each pass end in a slot (bounded, even when the pass
    was empty). True once they said all; False when the parent went away or asked for a
    rewind."""
    async for event in events:
        chan.poll()
        if chan.rewind is not None:
            return False
        if isinstance(event, Build):
            if not await build(worker, chan, event):
                return False
        elif isinstance(event, PassEnd):
            slot = await chan.slot()
            if slot is None:
                return False
            await chan.send(wire.PassEnd(slot, event.pass_no, event.batches))
        else:
            await chan.send(wire.Retiring(event.position.to_data()))
    return True


async def _run_index(worker: Serving, chan: Channel) -> None:
    """Answer the parent's index batches, in order, until it goes or we retire. With a load
    stage, each task's loads start as it arrives: loads overlap, batches go out in order."""
    stage = worker.stage
    if stage is None:
        touch = chan.progress if worker.spec.workers.progress else None
        async for task in _tasks(chan):
            if not await answer(worker, chan, task.seq, task.indices, touch=touch):
                return
        return
    source = worker.spec.source
    fetches = InOrder(_tasks(chan), lambda task: stage.fetch(source, task.indices))
    try:
        async for task, group in fetches:
            if not await answer(worker, chan, task.seq, task.indices, group):
                return
    finally:
        await fetches.aclose()


async def _tasks(chan: Channel) -> AsyncIterator[wire.Task]:
    while (task := await chan.task()) is not None:
        yield task
