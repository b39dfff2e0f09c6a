"""Thread workers (``worker_type="thread"``): a worker's loop in a thread of this process.

:class:`ThreadWorker` has the part of ``multiprocessing.Process`` the supervisor uses."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import socket
import threading
import weakref

from .. import _loops
from .._errors import SourcePicklingError
from .._info import TORCH_INFO_PER_THREAD
from ..pipeline._stacking import TORCH_COLLATE_IN_THREADS
from ..plane._dataplane import Shelf
from ..plans._sources import Kind, is_stateful
from ._spec import WorkerSpec
from ._worker import serve

log = logging.getLogger("aioloader")

# Live thread workers: a child forked meanwhile (a worker process of another loader) must
# not hold their ends open, or the parent would never see their EOF and sentinel.
_LIVE: weakref.WeakSet[ThreadWorker] = weakref.WeakSet()


def _drop_thread_fds_in_child() -> None:
    for worker in list(_LIVE):
        worker.forget_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_drop_thread_fds_in_child)


def own_source(spec: WorkerSpec) -> WorkerSpec:
    """``spec`` for one of several thread workers: a stream source that keeps its own
    position (``state_dict``) copied as a worker process gets it (pickle's semantics:
    ``deepcopy`` honours ``__getstate__``), so that one thread's ``load_state_dict`` and
    block marks do not overwrite another's and a resume loses nothing. Any other source
    (and a lone worker's) stays shared: nothing of its own to race on, no copy to pay for."""
    if (spec.workers.num_workers < 2 or spec.kind is Kind.MAP  # (asked no state)
            or not is_stateful(spec.source)):
        return spec
    try:
        source = copy.deepcopy(spec.source)
    except Exception as exc:
        raise SourcePicklingError(
            f"the source ({type(spec.source).__name__}) cannot be copied ({exc!r}), which "
            "worker_type='thread' needs: it keeps its own position (state_dict), so each "
            "of several thread workers reads its own copy, as a worker process does. Make "
            "it copyable (copy.deepcopy: a __getstate__ leaving out locks and open files), "
            "or use worker_type='process' or num_workers=1") from exc
    return dataclasses.replace(spec, source=source)


class ThreadWorker:
    """A worker thread as a process; ``sentinel``: a pipe's read end, closed when it ends."""

    def __init__(self, spec: WorkerSpec, sock: socket.socket, shelf: Shelf, name: str) -> None:
        self._spec = spec
        self._sock = sock  # the worker's end: the thread owns it (serve closes it)
        self._shelf = shelf
        self.name = name
        self.pid: int | None = os.getpid()
        self.sentinel = -1
        self._done = -1  # the pipe's write end
        self.exitcode: int | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[int] | None = None
        self._stopping = False
        self._abandoned = False

    def start(self) -> None:
        try:
            self.sentinel, self._done = os.pipe()
            _LIVE.add(self)
            self._thread.start()
        except BaseException:
            self._sock.close()
            if self._done >= 0:
                os.close(self._done)
            raise

    def _run(self) -> None:
        code = 1
        try:
            # torch's get_worker_info() answers per thread and its default_collate makes no
            # shared memory while any thread worker of this process lives.
            with TORCH_INFO_PER_THREAD.scope(), TORCH_COLLATE_IN_THREADS.scope():
                code = _loops.run(self._serve())
        except asyncio.CancelledError:
            code = 0 if self._stopping else 1
        except BaseException:  # serve reports the user's errors; this is ours
            log.exception("thread worker %s failed", self.name)
        finally:
            self._sock.close()  # serve closes it; not if the loop never started
            self.exitcode = code
            _LIVE.discard(self)
            os.close(self._done)  # last: the sentinel fires, join() returns at once

    async def _serve(self) -> int:
        task: asyncio.Task[int] | None = asyncio.current_task()
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), task
            stopping = self._stopping
        try:
            if stopping:  # terminated before its loop ran
                return 0
            return await serve(self._spec, self._sock, self._shelf)
        finally:
            with self._lock:
                self._loop = self._task = None

    def join(self, timeout: float | None = None) -> None:
        if threading.current_thread() is self._thread:
            return  # the GC's backstop can run in the worker thread itself
        if self._abandoned and timeout is None:
            timeout = 0.0
        self._thread.join(timeout)

    def terminate(self) -> None:
        """Cancel the serving task (blocking code cannot be interrupted and finishes first)."""
        with self._lock:
            self._stopping = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(task.cancel)

    def kill(self) -> None:
        """A thread cannot be killed: cancel it again and stop waiting for it."""
        self.terminate()
        if self._thread.is_alive():
            self._abandoned = True
            log.warning("thread worker %s does not stop (blocked outside its event loop); "
                        "it is left running as a daemon thread: threads cannot be killed",
                        self.name)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def forget_in_child(self) -> None:
        """In a forked child: close this worker's fds."""
        for fd in (self._done, self.sentinel):
            with contextlib.suppress(OSError):
                if fd >= 0:
                    os.close(fd)
        with contextlib.suppress(OSError):
            os.close(self._sock.detach())

