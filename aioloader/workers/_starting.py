"""Starting worker processes: the starter thread, parent sockets, standbys, the stop schedule.

Everything that makes or ends a process lives here, below the supervisor, which only says
what to start and when:

* **The starter thread** (:data:`STARTER`). Processes start from one long-lived thread:
  starting can block (spawn writes the pickled spec into a pipe the child reads only once
  Python is up), and the thread that forks a child is the "parent" ``PR_SET_PDEATHSIG``
  watches, so it must outlive the workers. A :class:`Launch` is one worker's start there.
* **Parent sockets.** The parent's end of every live worker's socket is registered
  (:func:`socket_pair`); a process forked later (another worker) closes them at once, or a
  worker would never see EOF when its parent closes or dies.
* **Forkserver warm-up** (:func:`warm_forkserver`, :func:`preload_modules`) and **spawn
  standbys** (:class:`StandbyPool`, issue 13): interpreters started when a loader is made,
  so their imports overlap the script's own set-up.
* **Pickling checks** (:func:`check_picklable`, :func:`spawn_dumps`): a spec that spawn or
  forkserver cannot send fails before any process starts.
* **The stop schedule** (:func:`stop_processes`): EOF, ``grace``, SIGTERM, :data:`KILL_AFTER`,
  SIGKILL, for every process of a session at once, starts in flight included (issue 19).

Spawn standbys, in more detail. A spawned worker imports torch, aioloader and the dataset's
module before it can do anything (1.3-2.6 s each here), and torch's loader pays that after the
first ``iter()``. A loader made with ``start_method="spawn"`` and process workers starts
``num_workers`` standby processes at once, from the starter thread: each is spawned like a
worker (a fresh interpreter, nothing inherited), imports those modules in
:func:`standby_main`, then waits on its socket.

When the loader's first session starts its workers, worker k takes a standby: its spec is
pickled then, in the starter thread, so the workers see the dataset as it is when the epoch
starts, as with torch. The spec goes as spawn's own start sends it: pickled by
``ForkingPickler`` while a stand-in for spawn's ``Popen`` collects the fds its reducers pass
(the worker's socket, tensors' shared memory), which follow with ``SCM_RIGHTS``. With it goes
what a process spawned at that moment would take from the parent and this one took earlier:
the working directory, ``sys.path`` and the environment variables that changed since the
standby started.

Standbys are used once. The first session that starts workers takes the whole pool, and the
ones it does not use (its start failed) are reaped with it; restarts, successors and later
sessions (``persistent_workers=False``, after a close) spawn as before: refilling the pool
would leave processes running where those promise none. A standby that is gone when its turn
comes (killed, say) is replaced by a process spawned then, without an error (one that dies
in the instant between that check and the send dies as a worker would). A standby whose
preloading fails goes on: unpickling the spec imports the module again and fails there as a
spawned worker's would. Closing or dropping a loader closes its standbys' sockets (EOF: they
exit) and reaps them; a forked child never holds those sockets.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol, TypeAlias

import torch.multiprocessing

from .._errors import UNGUARDED_MAIN, UNGUARDED_MAIN_EXIT, SourcePicklingError
from ._worker import WorkerSpec, forking, worker_main

STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioloader-start")

EXIT_GRACE = 1.0  # seconds a process told to go (EOF) gets before SIGTERM, where no one says
KILL_AFTER = 1.0  # seconds from SIGTERM to SIGKILL (a thread: to giving up on it)

# What a worker's spec carries of the user's: it must pickle for spawn and forkserver.

# Parent-side sockets of every live worker and standby. A process forked later (another
# worker) must not hold them open, or a worker would never see EOF when its parent closes or
# dies. The child also detaches the socket objects it inherited: one collected there later
# would close whatever its fd number has become by then (uvloop's io_uring fd: SIGABRT,
# issue 9).
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
    """Close the parent's end of a socket pair: EOF, the child's signal to go."""
    _PARENT_SOCKS.discard(sock)
    sock.close()


class Handle(Protocol):
    """What the supervisor and the stop schedule use of a worker: a process, or a
    ``ThreadWorker`` (aioloader/workers/_threads.py) that looks like one."""

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
        """The process once the start is done; None if the start failed before it."""
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
    """Submit the start of ``process`` (a thread worker owns ``child``: it closes it)."""
    launch = Launch(process, parent)
    launch.future = STARTER.submit(_start_process, launch, child)
    return launch


def hand_off_worker(standby: Standby, spec: WorkerSpec, fresh: BaseProcess,
                    parent: socket.socket, child: socket.socket) -> Launch:
    """Submit the hand-off of ``spec`` to ``standby``; where the standby is gone, the process
    ``fresh`` is started instead."""
    launch = Launch(standby.process, parent)
    launch.future = STARTER.submit(_hand_off, launch, spec, child, standby, fresh)
    return launch


def _unlist(process: BaseProcess) -> None:
    """multiprocessing polls every child it knows of whenever any process starts
    (process._cleanup): another loader's start would then race our reaping for the exit
    status (waitpid), and Process.close() could find "still running". We alone reap."""
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]


def _start(process: BaseProcess) -> None:
    """``process.start()``. In a process that spawn is still preparing (it re-runs the
    parent's script to import the main module, and the script has no ``__main__`` guard),
    multiprocessing refuses with a RuntimeError about "bootstrapping": that process then
    says why on stderr and exits with :data:`UNGUARDED_MAIN_EXIT`, which its parent's
    ``WorkerDied`` explains, instead of a bare "exit code 1" (issue 36)."""
    try:
        process.start()
    except RuntimeError:
        if not getattr(multiprocessing.process.current_process(), "_inheriting", False):
            raise
        sys.stderr.write(f"aioloader: a worker process stopped while it started: "
                         f"{UNGUARDED_MAIN}.\n")
        sys.stderr.flush()
        os._exit(UNGUARDED_MAIN_EXIT)


def _start_process(launch: Launch, child: socket.socket) -> None:
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
            _start(process)
        launch.started = True
        _unlist(process)
    finally:
        child.close()


def _hand_off(launch: Launch, spec: WorkerSpec, child: socket.socket, standby: Standby,
              fresh: BaseProcess) -> None:
    """In the starter thread: ``standby`` becomes the worker, given ``spec`` (pickled now, so
    it carries the dataset as it is when the epoch starts) and ``child``."""
    if launch.sock.fileno() < 0:  # stopped before its turn (see _start_process): unused
        standby.dismiss()
        launch.started = standby.started_process() is not None  # reaped with the others
        child.close()
        return
    try:
        taken = standby.hand_off(spec, child)
    except BaseException:
        launch.started = True  # it runs, and sees EOF: reaped with the others
        child.close()
        raise
    if taken:
        launch.started = True
        child.close()
        return
    launch.process = fresh
    _start_process(launch, child)


# ---------------------------------------------------------------------- the stop schedule

def stop_processes(processes: Sequence[Handle], grace: float,
                   starts: Starts | None = None) -> None:
    """Stop ``processes`` (started, and told to go: EOF) on one schedule, measured from
    now: ``grace`` seconds to exit, then terminate, KILL_AFTER seconds later kill (a thread:
    cancel it, then stop waiting); join and close each.

    ``starts``: starts in flight, each future mapped to what gives its process once it is
    done (None: nothing started). A process that starts meanwhile joins the schedule where
    it then is (past the deadline to terminate: terminated at once), and every wait runs to
    the same deadline, so nothing adds up per worker or per start (issue 19: a stop must be
    prompt under load). Only a start that outlasts the whole schedule is waited for, and
    its process killed the moment it exists.
    """
    started: list[Handle] = list(processes)
    waiting: Starts = dict(starts or {})
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


# ---------------------------------------------------------------------- before any start

def check_picklable(parts: dict[str, Any], start_method: str) -> None:
    """Raise SourcePicklingError naming the first of ``parts`` (the source, the collate
    function, ...: what a worker's spec carries) that cannot be pickled as spawn and
    forkserver send it."""
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
        ctx.set_forkserver_preload(preload_modules(source))
        with contextlib.suppress(OSError):  # the first epoch then says what is wrong
            multiprocessing.forkserver.ensure_running()

    STARTER.submit(start)


def preload_modules(source: Any) -> list[str]:
    """What a forkserver imports once, before it forks any worker: the main module (the
    multiprocessing default this list replaces), torch and aioloader, and the module of the
    source's class. Each worker then forks from it warm instead of importing them itself
    (0.7-0.9 s a worker measured here, issue 13). Only the server's first start reads it;
    a module that fails to import is skipped there. Spawn standbys import the same list."""
    modules = ["__main__", "aioloader.workers._worker"]
    home = getattr(type(source), "__module__", None)
    if isinstance(home, str) and home not in ("__main__", "builtins"):
        modules.append(home)
    return modules


# ---------------------------------------------------------------------- spawn standbys

_HEADER = struct.Struct("!QQI")  # bytes of the changes, bytes of the spec, fds passed
_FDS_PER_MESSAGE = 250  # SCM_MAX_FD is 253 on Linux
_RECEIVED: dict[int, int] = {}  # in a standby, while its spec is unpickled: index -> fd


@dataclass(frozen=True)
class Surroundings:
    """What a spawned process takes from its parent when it starts (spawn's preparation
    data and the environment)."""

    cwd: str
    path: tuple[str, ...]
    environ: dict[str, str]

    @classmethod
    def now(cls) -> Surroundings:
        return cls(os.getcwd(), tuple(sys.path), dict(os.environ))

    def changes_since(self, then: Surroundings) -> Changes:
        return Changes(
            cwd=self.cwd if self.cwd != then.cwd else None,
            path=self.path if self.path != then.path else None,
            set={k: v for k, v in self.environ.items() if then.environ.get(k) != v},
            unset=tuple(k for k in then.environ if k not in self.environ))


@dataclass(frozen=True)
class Changes:
    """How the parent's surroundings changed since a standby started: applied in the
    standby before its spec is unpickled."""

    cwd: str | None
    path: tuple[str, ...] | None
    set: dict[str, str]
    unset: tuple[str, ...]

    def apply(self) -> None:
        if self.cwd is not None:
            os.chdir(self.cwd)
        if self.path is not None:
            sys.path[:] = self.path
        for key in self.unset:
            os.environ.pop(key, None)
        os.environ.update(self.set)


@dataclass(eq=False)
class Standby:
    """One standby process and the parent's end of its socket."""

    process: BaseProcess
    sock: socket.socket
    surroundings: Surroundings | None = None  # taken when it started
    started: concurrent.futures.Future[None] = field(
        default_factory=concurrent.futures.Future)

    def start(self, child: socket.socket) -> None:
        """In the starter thread."""
        try:
            self.surroundings = Surroundings.now()
            _start(self.process)
            _unlist(self.process)
        finally:
            child.close()

    def hand_off(self, spec: WorkerSpec, worker_sock: socket.socket) -> bool:
        """In the starter thread: make this process worker ``spec.worker_id``, talking over
        ``worker_sock``. False when it is gone (it is reaped): spawn another instead."""
        try:
            if self.started.exception() is not None or self.exited():
                _stop([self], 0.0)
                return False
            assert self.surroundings is not None
            changes = pickle.dumps(Surroundings.now().changes_since(self.surroundings))
            payload, fds = spawn_dumps((spec, worker_sock))
            try:
                _send(self.sock, changes, payload, fds)
            except OSError:  # it died meanwhile (EPIPE, ECONNRESET)
                _stop([self], EXIT_GRACE)
                return False
            return True
        finally:
            self.dismiss()

    def exited(self) -> bool:
        """Whether the started process has exited. Its sentinel, not ``exitcode``: the
        kernel closes a dying process's fds (the sentinel first when its number is lower)
        before ``waitpid`` can reap it, so a parent that saw the sentinel could still find
        ``exitcode`` None, and hand its spec to a socket the dying process has not closed."""
        return bool(multiprocessing.connection.wait([self.process.sentinel], timeout=0))

    def dismiss(self) -> None:
        """Close our end: a standby still waiting sees EOF and exits."""
        close_parent(self.sock)

    def started_process(self) -> BaseProcess | None:
        """The process once its start is done; None if that start failed."""
        return self.process if self.started.exception() is None else None


class StandbyPool:
    """A loader's standby processes, until its first session takes them or it goes."""

    def __init__(self, source: Any, count: int) -> None:
        self._modules = preload_modules(source)
        self._count = count
        self._lock = threading.Lock()
        self._idle: list[Standby] = []
        self._done = False
        self._starting: concurrent.futures.Future[None] | None = None
        self.owner_pid = os.getpid()

    def start(self, parts: dict[str, Any]) -> None:
        """Spawn the standbys from the starter thread; returns at once.

        ``parts`` (what the workers' spec will carry, by name: ``WorkerSpec.parts()``) are
        pickled there first: if one cannot be, no standby starts, and the first epoch
        fails with SourcePicklingError before any process starts, as it would without them.
        """
        self._starting = STARTER.submit(self._start, parts)

    def _start(self, parts: dict[str, Any]) -> None:
        try:
            check_picklable(parts, "spawn")
        except SourcePicklingError:  # the epoch's own check says so, before any start
            return
        ctx: Any = torch.multiprocessing.get_context("spawn")
        with self._lock:
            if self._done or self._idle:
                return
            for i in range(self._count):
                parent, child = socket_pair()
                process = ctx.Process(target=standby_main, args=(child, self._modules),
                                      daemon=True, name=f"aioloader-standby-{i}")
                standby = Standby(process, parent)
                standby.started = STARTER.submit(standby.start, child)
                self._idle.append(standby)

    def take_all(self) -> list[Standby]:
        """The standbys, for the first session that starts workers; the pool is done."""
        with self._lock:
            self._done = True
            taken, self._idle = self._idle, []
        return taken

    def pids(self) -> list[int | None]:
        """The idle standbys' pids, once started (diagnostics and tests)."""
        if self._starting is not None:
            self._starting.result()
        with self._lock:
            idle = list(self._idle)
        concurrent.futures.wait([s.started for s in idle])
        return [s.process.pid for s in idle]

    def close(self, grace: float = EXIT_GRACE) -> None:
        """Dismiss the standbys no session took, and reap them."""
        if os.getpid() == self.owner_pid:
            self.release(self.take_all(), grace)

    @staticmethod
    def release(standbys: list[Standby], grace: float) -> None:
        """Dismiss ``standbys`` and reap them: EOF, ``grace`` seconds, then SIGTERM and
        SIGKILL, as the supervisor reaps its workers."""
        for standby in standbys:
            standby.dismiss()
        # A standby still starting joins the schedule once it exists (stop_processes).
        stop_processes([], grace, {s.started: s.started_process for s in standbys})


def _stop(standbys: list[Standby], grace: float) -> None:
    """Wait ``grace`` seconds for started ``standbys`` to exit, then terminate, then kill."""
    stop_processes([s.process for s in standbys
                    if s.started.done() and s.started.exception() is None], grace)


def standby_main(sock: socket.socket, modules: list[str]) -> None:
    """A standby's life: import what a worker needs, wait for a spec, be that worker."""
    # Ctrl-C reaches the whole process group: the parent decides (as in a worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in modules:
        with contextlib.suppress(Exception):  # retried when the spec is unpickled
            importlib.import_module(name)
    with sock:
        handed = _receive(sock)
    if handed is None:
        return  # EOF: the loader went, or did not need this one
    spec, worker_sock = handed
    multiprocessing.current_process().name = f"aioloader-worker-{spec.worker_id}"
    worker_main(spec, worker_sock)


def spawn_dumps(obj: object) -> tuple[memoryview, list[int]]:
    """``obj`` pickled as spawn's start pickles a process, and the fds to pass with it.

    Without a spawning ``Popen``, ``DupFd`` would register a duplicate of each fd with
    multiprocessing's resource sharer (a thread and a listening socket), held until a child
    asks for it: a check that only pickles would leak one fd per tensor storage.
    """
    passing = _Passing()
    multiprocessing.context.set_spawning_popen(passing)  # type: ignore[arg-type]
    try:
        return ForkingPickler.dumps(obj), passing.fds
    finally:
        multiprocessing.context.set_spawning_popen(None)


class _Passing:
    """Stands in for spawn's ``Popen`` while a spec is pickled: the fds that reducers pass
    (``multiprocessing.reduction.DupFd``) are collected, to be sent with ``SCM_RIGHTS``."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1

    def DupFd(self, index: int) -> _PassedFd:  # multiprocessing calls it so
        return _PassedFd(index)


@dataclass(frozen=True)
class _PassedFd:
    """An fd sent with a spec, by its place among the fds that came with it."""

    index: int

    def detach(self) -> int:
        return _RECEIVED.pop(self.index)


def _send(sock: socket.socket, changes: bytes, payload: bytes | memoryview,
          fds: list[int]) -> None:
    flags = socket.MSG_NOSIGNAL
    sock.sendall(_HEADER.pack(len(changes), len(payload), len(fds)), flags)
    for at in range(0, len(fds), _FDS_PER_MESSAGE):  # one byte carries each batch of fds
        socket.send_fds(sock, [b"\0"], fds[at:at + _FDS_PER_MESSAGE], flags)
    sock.sendall(changes, flags)
    sock.sendall(payload, flags)


def _receive(sock: socket.socket) -> tuple[WorkerSpec, socket.socket] | None:
    """The spec and the worker's socket, or None at EOF (the parent closed or died)."""
    fds: list[int] = []
    try:
        head = _read(sock, _HEADER.size, fds)
        if head is None:
            return None
        n_changes, n_payload, n_fds = _HEADER.unpack(head)
        rest = _read(sock, -(-n_fds // _FDS_PER_MESSAGE) + n_changes + n_payload, fds)
        if rest is None:
            return None
        if len(fds) != n_fds:
            raise RuntimeError(f"expected {n_fds} fds with the spec, got {len(fds)}")
        body = memoryview(rest)[len(rest) - n_changes - n_payload:]
        changes: Changes = pickle.loads(body[:n_changes])
        changes.apply()  # sys.path first: unpickling the spec imports modules
        _RECEIVED.update(enumerate(fds))
        fds = []
        spec, worker_sock = pickle.loads(body[n_changes:])
        return spec, worker_sock
    finally:
        for fd in [*fds, *_RECEIVED.values()]:  # none a reducer took
            os.close(fd)
        _RECEIVED.clear()


def _read(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    """Exactly ``n`` bytes (the fds that come with them go to ``fds``); None at EOF."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        data, passed, flags, _addr = socket.recv_fds(sock, min(n - got, 1 << 20),
                                                     _FDS_PER_MESSAGE + 3)
        fds.extend(passed)
        if flags & socket.MSG_CTRUNC:
            raise RuntimeError("fds sent with the spec were cut off")
        if not data:
            return None
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)
