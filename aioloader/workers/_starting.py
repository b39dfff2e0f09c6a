"""Worker processes: the starter thread, parent sockets, the stop schedule.

Below the supervisor, which only says what to start and when."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, TypeAlias, TypeVar

import torch.multiprocessing

from .._errors import UNGUARDED_MAIN, UNGUARDED_MAIN_EXIT
from ._spec import WorkerSpec
from ._worker import forking, worker_main

T = TypeVar("T")


class _Starter:
    """The starter thread as an executor, one a process (docs/architecture.md): starting can
    block, and the forking thread is the "parent" ``PR_SET_PDEATHSIG`` watches."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget_in_child)

    def submit(self, fn: Callable[..., T], /, *args: Any) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="aioloader-start")
            return self._pool.submit(fn, *args)

    def _forget_in_child(self) -> None:
        self._pool = None  # (its thread is not here; the parent still runs it)
        self._lock = threading.Lock()


STARTER = _Starter()

EXIT_GRACE = 1.0  # seconds a process told to go (EOF) gets before SIGTERM, where no one says
KILL_AFTER = 1.0  # seconds from SIGTERM to SIGKILL (a thread: to giving up on it)

# Parent-side sockets of every live worker and standby. A process forked later (another
# worker) must not hold them open, or a worker would never see EOF when its parent closes or
# dies; it detaches the objects too (docs/architecture.md: uvloop's io_uring fd, issue 9).
_PARENT_SOCKS: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _close_parent_socks_in_child() -> None:
    for sock in list(_PARENT_SOCKS):
        with contextlib.suppress(OSError):
            os.close(sock.detach())
    _PARENT_SOCKS.clear()


os.register_at_fork(after_in_child=_close_parent_socks_in_child)


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A worker's (or standby's) socketpair: the parent's end, registered, and the child's."""
    parent, child = socket.socketpair()
    _PARENT_SOCKS.add(parent)
    return parent, child


def close_parent(sock: socket.socket) -> None:
    """EOF: the child's signal to go."""
    _PARENT_SOCKS.discard(sock)
    sock.close()


class Handle(Protocol):
    """What the supervisor uses of a worker: a process, or a ``ThreadWorker``."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


# Starts in flight: each future, and what gives its process once it is done (None: none).
Starts: TypeAlias = dict[concurrent.futures.Future[Any], Callable[[], Handle | None]]


@dataclass(eq=False)
class Launch:
    """One worker's start, run to its end in the starter thread whatever its caller does.

    ``sock`` is the parent's end of the worker's socket: closed before the start's turn
    comes, the start is never made, so a stop waits for no start queued behind one in
    flight (issue 19). ``process`` may change there once (a standby gone: a fresh process).
    """

    process: Handle
    sock: socket.socket
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    started: bool = False  # set in the starter thread: a process (or thread) runs

    def started_process(self) -> Handle | None:
        """The process once the start is done; None if it failed before."""
        return self.process if self.started else None


def new_process(spec: WorkerSpec, child: socket.socket, start_method: str) -> BaseProcess:
    """Worker ``spec.worker_id``'s process, not started, talking over ``child``."""
    ctx: Any = torch.multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(preload_modules(spec.source))
    process: BaseProcess = ctx.Process(target=worker_main, args=(spec, child), daemon=True,
                                       name=f"aioloader-worker-{spec.worker_id}")
    return process


def start_worker(process: Handle, parent: socket.socket, child: socket.socket) -> Launch:
    """Submit the start of ``process`` (a thread worker closes ``child`` itself)."""
    launch = Launch(process, parent)
    launch.future = STARTER.submit(start_launch, launch, child)
    return launch


def start_child(process: BaseProcess) -> None:
    """``process.start()``, then unlisted: multiprocessing polls every child it knows of
    whenever any process starts, which would race our reaping for the exit status.

    In a process that spawn is still preparing (it re-runs the parent's script, which has
    no ``__main__`` guard), multiprocessing refuses with a RuntimeError about
    "bootstrapping": that process then says why on stderr and exits with
    :data:`UNGUARDED_MAIN_EXIT`, which its parent's ``WorkerDied`` explains (issue 36)."""
    try:
        process.start()
    except RuntimeError:
        if not getattr(multiprocessing.process.current_process(), "_inheriting", False):
            raise
        sys.stderr.write(f"aioloader: a worker process stopped while it started: "
                         f"{UNGUARDED_MAIN}.\n")
        sys.stderr.flush()
        os._exit(UNGUARDED_MAIN_EXIT)
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]


def start_launch(launch: Launch, child: socket.socket) -> None:
    """In the starter thread: start the process, then drop the child's end."""
    if launch.sock.fileno() < 0:  # stopped (or retired) while this start waited its turn
        child.close()
        return
    process = launch.process
    if not isinstance(process, BaseProcess):
        process.start()  # a thread: it owns the child's end and closes it
        launch.started = True
        return
    try:
        with forking():  # fork: the worker never finalizes what it inherits (issue 19)
            start_child(process)
        launch.started = True
    finally:
        child.close()


# ---------------------------------------------------------------------- the stop schedule

def stop_processes(grace: float, starts: Starts) -> None:
    """Stop the processes of ``starts`` (told to go: EOF) on one schedule from now: ``grace``
    seconds to exit, then terminate, KILL_AFTER seconds later kill; join and close each.

    ``starts``: each start, done or in flight, and what gives its process (None: none). A
    process that starts meanwhile joins the schedule where it then is, and every wait runs
    to the same deadline, so nothing adds up per worker or per start (issue 19: a stop must
    be prompt under load). Only a start that outlasts the whole schedule is waited for.
    """
    started: list[Handle] = []
    waiting: Starts = dict(starts)
    taken: list[str] = []  # the escalations so far, for a process that starts late
    deadline = time.monotonic() + grace
    for escalate in (None, "terminate", "kill"):
        if escalate is not None:
            taken.append(escalate)
            for p in started:
                if p.exitcode is None:
                    getattr(p, escalate)()
            deadline = time.monotonic() + KILL_AFTER
        _take_started(waiting, started, taken, deadline)
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
        if not waiting and all(p.exitcode is not None for p in started):
            break
    _take_started(waiting, started, ["kill"], None)
    for p in started:
        p.join()
        p.close()


def _take_started(waiting: Starts, started: list[Handle], taken: list[str],
                  deadline: float | None) -> None:
    """Wait for ``waiting`` until ``deadline``; a process started gets the ``taken`` steps."""
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


# ---------------------------------------------------------------------- forkserver

def warm_forkserver(source: Any) -> None:
    """Start the forkserver now, in the background: the first epoch forks from it warm."""
    def start() -> None:
        import multiprocessing.forkserver

        ctx: Any = torch.multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(preload_modules(source))
        with contextlib.suppress(OSError):  # the first epoch then says what is wrong
            multiprocessing.forkserver.ensure_running()

    STARTER.submit(start)


def preload_modules(source: Any) -> list[str]:
    """What a forkserver (or a spawn standby) imports before it forks any worker: the main
    module, torch and aioloader, and the module of the source's class (0.7-0.9 s a worker
    saved here, issue 13). A module that fails to import is skipped there."""
    modules = ["__main__", "aioloader.workers._worker"]
    home = getattr(type(source), "__module__", None)
    if isinstance(home, str) and home not in ("__main__", "builtins"):
        modules.append(home)
    return modules
