"""Spawn standbys (issue 13): worker interpreters started when a loader is made.

Each imports what a worker needs at once (docs/architecture.md); the first session's worker k
takes one, its spec pickled then, as spawn's start sends it, with the working directory,
``sys.path`` and environment variables changed since it started. Standbys are used once:
restarts, successors and later sessions spawn as before (refilling the pool would leave
processes running where those promise none).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing

from .._errors import SourcePicklingError
from ._pickling import check_picklable, fds_passed, spawn_dumps
from ._spec import WorkerSpec
from ._starting import (
    EXIT_GRACE,
    STARTER,
    Launch,
    close_parent,
    preload_modules,
    socket_pair,
    start_child,
    start_launch,
    stop_processes,
)
from ._worker import worker_main

_HEADER = struct.Struct("!QQI")  # bytes of the changes, bytes of the spec, fds passed
_FDS_PER_MESSAGE = 250  # SCM_MAX_FD is 253 on Linux


@dataclass(frozen=True)
class Surroundings:
    """What a spawned process takes from its parent when it starts."""

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
    """How the parent's surroundings changed since a standby started."""

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

    def start(self, child: socket.socket) -> None:  # in the starter thread
        try:
            self.surroundings = Surroundings.now()
            start_child(self.process)
        finally:
            child.close()

    def hand_off(self, spec: WorkerSpec, worker_sock: socket.socket) -> bool:
        """In the starter thread: become worker ``spec``; False when gone (spawn another)."""
        try:
            # Its sentinel, not ``exitcode``: the kernel closes a dying process's fds before
            # ``waitpid`` can reap it, and its spec would go to a socket not closed yet.
            if self.started.exception() is not None or multiprocessing.connection.wait(
                    [self.process.sentinel], timeout=0):
                release([self], 0.0)
                return False
            assert self.surroundings is not None
            changes = pickle.dumps(Surroundings.now().changes_since(self.surroundings))
            payload, fds = spawn_dumps((spec, worker_sock))
            try:
                _send(self.sock, changes, payload, fds)
            except OSError:  # it died meanwhile (EPIPE, ECONNRESET)
                release([self], EXIT_GRACE)
                return False
            return True
        finally:
            self.dismiss()

    def dismiss(self) -> None:
        """EOF: a standby still waiting exits."""
        close_parent(self.sock)

    def started_process(self) -> BaseProcess | None:
        return self.process if self.started.exception() is None else None


class StandbyPool:
    """A loader's standby processes, until its first session takes them."""

    def __init__(self, source: Any, count: int) -> None:
        self._modules = preload_modules(source)
        self._count = count
        self._lock = threading.Lock()
        self._idle: list[Standby] = []
        self._done = False
        self._starting: concurrent.futures.Future[None] | None = None
        self.owner_pid = os.getpid()

    def start(self, parts: dict[str, Any]) -> None:
        """Spawn the standbys from the starter thread (none if ``parts`` do not pickle)."""
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
        """The standbys, for the first session that starts workers."""
        with self._lock:
            self._done = True
            taken, self._idle = self._idle, []
        return taken

    def pids(self) -> list[int | None]:
        """The idle standbys' pids, once started (for tests)."""
        if self._starting is not None:
            self._starting.result()
        with self._lock:
            idle = list(self._idle)
        concurrent.futures.wait([s.started for s in idle])
        return [s.process.pid for s in idle]

    def close(self, grace: float = EXIT_GRACE) -> None:
        if os.getpid() == self.owner_pid:
            release(self.take_all(), grace)


def release(standbys: list[Standby], grace: float) -> None:
    """Dismiss ``standbys`` and reap them on the workers' stop schedule."""
    for standby in standbys:
        standby.dismiss()
    stop_processes(grace, {s.started: s.started_process for s in standbys})


def standby_main(sock: socket.socket, modules: list[str]) -> None:
    """Import what a worker needs, wait for a spec, be that worker."""
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


def hand_off_worker(standby: Standby, spec: WorkerSpec, fresh: BaseProcess,
                    parent: socket.socket, child: socket.socket) -> Launch:
    """Submit the hand-off of ``spec`` to ``standby`` (``fresh`` where it is gone)."""
    launch = Launch(standby.process, parent)
    launch.future = STARTER.submit(_hand_off, launch, spec, child, standby, fresh)
    return launch


def _hand_off(launch: Launch, spec: WorkerSpec, child: socket.socket, standby: Standby,
              fresh: BaseProcess) -> None:
    """In the starter thread: ``standby`` becomes the worker, given ``spec`` and ``child``."""
    if launch.sock.fileno() < 0:  # stopped before its turn (see start_launch): unused
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
    start_launch(launch, child)


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
        passed, fds = fds, []
        with fds_passed(passed):
            spec, worker_sock = pickle.loads(body[n_changes:])
        return spec, worker_sock
    finally:
        for fd in fds:
            os.close(fd)


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

