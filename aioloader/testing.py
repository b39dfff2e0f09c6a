"""Public test helpers: readers that fail, stall or kill their worker, and a leak checker.

The readers are plain module-level classes, so that ``start_method="spawn"`` can pickle
them. Each decides *where* it misbehaves from :func:`aioloader.get_worker_info`, so a test
can make exactly one worker fail while the others keep going.

Examples:
    >>> import aioloader
    >>> from aioloader.testing import FailingReader, leak_check
    >>> loader = aioloader.DataLoader(FailingReader(10, fail_at=3), batch_size=2,
    ...                               num_workers=0, quiet=True)
    >>> with leak_check():
    ...     try:
    ...         list(loader)
    ...     except RuntimeError as exc:
    ...         print(exc)
    FailingReader: instance 3 of 10
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ._info import get_worker_info
from .plans._sources import Reader

__all__ = [
    "AsyncFailingReader",
    "CountingReader",
    "FailingReader",
    "KillingReader",
    "LeakError",
    "LeakSnapshot",
    "SlowReader",
    "leak_check",
    "warm_up",
]

HowToDie = Literal["exit", "sigkill", "segv", "oom"]

# multiprocessing's own long-lived helpers: one per parent process, not per loader.
# How multiprocessing starts its helpers (``-c 'from multiprocessing.forkserver import
# main; ...'``): the module names, not a bare word that a forked worker's command line (its
# parent's, say ``pytest tests/test_forkserver.py``) may hold too.
HELPER_MARKERS = ("multiprocessing.resource_tracker", "multiprocessing.semaphore_tracker",
                  "multiprocessing.forkserver")


def _in_target_worker(worker: int | None) -> bool:
    info = get_worker_info()
    if info is None:
        return worker is None
    return worker is None or info.id == worker


class FailingReader(Reader):
    """Yields ``{"index": i}`` for ``i < n`` and raises ``RuntimeError`` at ``fail_at``.

    ``worker``: only that worker raises (``None``: every worker; the loader shards a
    reader's output, so every worker runs ``read()`` over all instances).
    """

    def __init__(self, n: int, fail_at: int, worker: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.worker = worker

    def read(self, data_path: Any = None) -> Iterator[dict[str, int]]:
        for i in range(self.n):
            if i == self.fail_at and (self.worker is None or _in_target_worker(self.worker)):
                raise RuntimeError(f"FailingReader: instance {i} of {self.n}")
            yield {"index": i}


class AsyncFailingReader(FailingReader):
    """:class:`FailingReader` as an async generator."""

    async def read(self, data_path: Any = None) -> AsyncIterator[dict[str, int]]:  # type: ignore[override]
        for i in range(self.n):
            if i == self.fail_at and (self.worker is None or _in_target_worker(self.worker)):
                raise RuntimeError(f"AsyncFailingReader: instance {i} of {self.n}")
            yield {"index": i}


class SlowReader(Reader):
    """Yields ``{"index": i}`` for ``i < n``, sleeping ``delay`` seconds before each.

    ``stall_at``: before that instance it sleeps ``stall`` seconds instead (a reader that
    hangs, for ``timeout=``). ``worker`` limits the stall to one worker.
    """

    def __init__(self, n: int, delay: float = 0.0, stall_at: int | None = None,
                 stall: float = 3600.0, worker: int | None = None) -> None:
        self.n = n
        self.delay = delay
        self.stall_at = stall_at
        self.stall = stall
        self.worker = worker

    def read(self, data_path: Any = None) -> Iterator[dict[str, int]]:
        for i in range(self.n):
            if i == self.stall_at and _in_target_worker(self.worker):
                time.sleep(self.stall)
            elif self.delay:
                time.sleep(self.delay)
            yield {"index": i}


class KillingReader(Reader):
    """Yields ``{"index": i}``; at instance ``die_at`` the worker dies without a word.

    ``how``: ``"exit"`` (``os._exit(exit_code)``), ``"sigkill"``, ``"segv"`` (a real
    segmentation fault, reading address 0) or ``"oom"`` (caps the worker's address space
    ``memory_limit`` bytes above what it maps now with ``RLIMIT_AS``, then allocates past
    the cap: the worker raises ``MemoryError``, as a worker under a memory limit does).
    Only worker ``worker`` dies; in the main process (``num_workers=0``) it refuses to kill
    the caller and raises instead. ``stamp_file``: the worker writes ``time.time()`` there
    just before it dies (to measure how long the loader takes to notice).
    """

    def __init__(self, n: int, die_at: int, how: HowToDie = "exit", worker: int | None = 0,
                 exit_code: int = 3, memory_limit: int = 256 << 20,
                 stamp_file: str | None = None) -> None:
        self.stamp_file = stamp_file
        self.n = n
        self.die_at = die_at
        self.how = how
        self.worker = worker
        self.exit_code = exit_code
        self.memory_limit = memory_limit

    def read(self, data_path: Any = None) -> Iterator[dict[str, int]]:
        for i in range(self.n):
            if i == self.die_at and _in_target_worker(self.worker):
                if get_worker_info() is None:
                    raise RuntimeError("KillingReader only kills worker processes")
                if self.stamp_file is not None:
                    with open(self.stamp_file, "w") as f:
                        f.write(repr(time.time()))
                die(self.how, self.exit_code, self.memory_limit)
            yield {"index": i}


def die(how: HowToDie, exit_code: int = 3, memory_limit: int = 256 << 20) -> None:
    """End this process abruptly, as a crashing worker would."""
    if how == "exit":
        os._exit(exit_code)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        # faulthandler would print a traceback first; the process still dies of SIGSEGV.
        ctypes.string_at(0)
    elif how == "oom":
        # Cap the address space a little above what is mapped now, then ask for more in
        # one allocation: it fails at once (MemoryError) without touching the pages.
        limit = _address_space() + memory_limit
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        bytearray(2 * memory_limit)
    time.sleep(3600)  # a signal is on its way
    raise AssertionError("unreachable")


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    return pages * os.sysconf("SC_PAGE_SIZE")


class CountingReader(Reader):
    """An endless reader that writes how many instances it produced to ``progress_file``.

    Each worker writes ``<progress_file>.<worker id>`` (``.main`` without workers): a test
    reads them to see that a slow consumer holds the workers back.
    """

    def __init__(self, progress_file: str, size: int = 1024) -> None:
        self.progress_file = progress_file
        self.size = size

    def read(self, data_path: Any = None) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        path = f"{self.progress_file}.{info.id if info is not None else 'main'}"
        i = 0
        while True:
            with open(path + ".tmp", "w") as f:
                f.write(str(i))
            os.replace(path + ".tmp", path)
            yield {"index": i, "payload": bytes(self.size)}
            i += 1


# --------------------------------------------------------------------------- leak checking

def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return data[data.rfind(")") + 2:].split()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int | None = None) -> list[int]:
    """Every live (not zombie) descendant of ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(int(st[1]), []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return [p for p in out if is_alive(p)]


def members(*, group: int | None = None, session: int | None = None) -> list[int]:
    """Live (not zombie) processes of process group ``group`` or of session ``session``."""
    field, value = (2, group) if group is not None else (3, session)
    if value is None:
        raise TypeError("members() needs group= or session=")
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] not in ("Z", "X", "x") and int(st[field]) == value:
                out.append(int(name))
    return out


def is_alive(pid: int) -> bool:
    """Running or sleeping; a zombie counts as dead."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X", "x")


def is_helper(pid: int) -> bool:
    """multiprocessing's resource tracker or forkserver: they persist by design."""
    cmd = _cmdline(pid)
    return any(marker in cmd for marker in HELPER_MARKERS)


def describe_pids(pids: list[int] | set[int]) -> str:
    return ", ".join(f"{p} {_cmdline(p)[:80]!r}" for p in sorted(pids)) or "none"


def _fds() -> dict[int, str]:
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd of the listing itself, closed by now
    return out


def _helper_fds() -> set[int]:
    """The fds this process keeps to multiprocessing's helpers for good: the forkserver's
    "alive" pipe and the resource tracker's pipe (a loader may start either; see
    :func:`is_helper`)."""
    from multiprocessing import forkserver, resource_tracker

    fds = {getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
           getattr(resource_tracker._resource_tracker, "_fd", None)}
    return {fd for fd in fds if isinstance(fd, int)}


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


_REGISTERED: dict[str, int] = {}  # /dev/shm name -> registrations by this process, unmatched
_SHM_FILE = {"semaphore": "sem.{}", "shared_memory": "{}"}  # resource tracker name -> file


def _track_registrations() -> None:
    """Count this process's own named semaphores and shared-memory blocks: multiprocessing
    registers each with its resource tracker while it exists (wrapped once, idempotent)."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker, "_aioloader_tracked", False):
        return
    # multiprocessing calls the module's functions (bound methods of its one tracker)
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def file_of(name: str, rtype: str) -> str | None:
        pattern = _SHM_FILE.get(rtype)
        return pattern.format(name.lstrip("/")) if pattern else None

    def tracked_register(name: str, rtype: str) -> None:
        if (path := file_of(name, rtype)) is not None:
            _REGISTERED[path] = _REGISTERED.get(path, 0) + 1
        register(name, rtype)

    def tracked_unregister(name: str, rtype: str) -> None:
        if (path := file_of(name, rtype)) is not None and _REGISTERED.get(path, 0) > 0:
            _REGISTERED[path] -= 1
        unregister(name, rtype)

    resource_tracker.register = tracked_register  # type: ignore[assignment]
    resource_tracker.unregister = tracked_unregister  # type: ignore[assignment]
    resource_tracker._aioloader_tracked = True  # type: ignore[attr-defined]


def _shm_owned(pids: set[int]) -> set[str]:
    """The /dev/shm names that are this process tree's own: open or mapped by one of
    ``pids``, named after one of them (torch's ``torch_<pid>_...``), or registered by this
    process with multiprocessing's resource tracker and not yet unregistered. Names made by
    other programs on the machine are none of these (issue 19: the whole /dev/shm flaked)."""
    owned = {name for name, count in _REGISTERED.items() if count > 0}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        owned.add(target[len("/dev/shm/"):].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if " /dev/shm/" in line:
                    owned.add(line.split(" /dev/shm/", 1)[1].strip().removesuffix(" (deleted)"))
    marks = tuple(f"_{pid}_" for pid in pids)
    return owned | {name for name in _shm() if any(mark in name for mark in marks)}


def _own_shm(pids: set[int] | None = None) -> set[str]:
    """The /dev/shm entries that exist now and belong to ``pids`` (default: this process
    and its descendants): see :func:`_shm_owned`."""
    pids = {os.getpid(), *descendants()} if pids is None else pids
    return _shm_owned(pids) & _shm()


class LeakError(AssertionError):
    """Processes, fds or /dev/shm entries outlived the checked block."""


@dataclass
class LeakSnapshot:
    """What this process holds: child processes, open fds, /dev/shm entries (all of them,
    and which of them are this process tree's own)."""

    children: set[int] = field(default_factory=set)
    fds: dict[int, str] = field(default_factory=dict)
    shm: set[str] = field(default_factory=set)
    own_shm: set[str] = field(default_factory=set)

    @classmethod
    def take(cls, include_helpers: bool = False) -> LeakSnapshot:
        everyone = descendants()
        kids = {p for p in everyone if include_helpers or not is_helper(p)}
        fds = _fds()
        if not include_helpers:
            for fd in _helper_fds():
                fds.pop(fd, None)
        _track_registrations()
        return cls(kids, fds, _shm(), _own_shm({os.getpid(), *everyone}))

    def new_since(self, baseline: LeakSnapshot) -> list[str]:
        """Human-readable lines for everything here that the baseline lacks."""
        problems: list[str] = []
        kids = self.children - baseline.children
        if kids:
            problems.append(f"child processes still alive: {describe_pids(kids)}")
        fds = {fd: target for fd, target in self.fds.items()
               if baseline.fds.get(fd) != target}
        if fds:
            problems.append("fds still open: " + ", ".join(
                f"{fd} -> {target}" for fd, target in sorted(fds.items())))
        shm = self.own_shm - baseline.shm
        if shm:
            problems.append(f"/dev/shm entries left: {sorted(shm)}")
        return problems


def check_leaks(baseline: LeakSnapshot, deadline: float = 10.0,
                include_helpers: bool = False) -> None:
    """Wait up to ``deadline`` seconds for everything new since ``baseline`` to go.

    Raises :class:`LeakError` naming what is left. Only new fds count (an fd number the
    baseline held, pointing at the same target, is the baseline's).
    """
    end = time.monotonic() + deadline
    while True:
        gc.collect()
        problems = LeakSnapshot.take(include_helpers).new_since(baseline)
        if not problems or time.monotonic() > end:
            break
        time.sleep(0.05)  # polling /proc: there is nothing to wait on for another's exit
    if problems:
        raise LeakError(f"leaked after {deadline:.0f}s: " + "; ".join(problems))


def warm_up() -> None:
    """Create the process-wide resources that live until exit, before a baseline is taken.

    libuv opens one signal pipe per process the first time a uvloop loop runs, and the
    first spawned worker starts multiprocessing's resource tracker (a process and a pipe
    kept for the life of this one); neither is a leak of any loader, but both would look
    like one to the first check.
    """
    import asyncio
    from multiprocessing import resource_tracker

    from ._loops import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(asyncio.sleep(0))
    resource_tracker.ensure_running()


@contextlib.contextmanager
def leak_check(deadline: float = 10.0, include_helpers: bool = False) -> Iterator[LeakSnapshot]:
    """Fail if child processes, fds or /dev/shm entries started inside outlive the block.

    multiprocessing's resource tracker and forkserver persist by design and are ignored
    unless ``include_helpers``. Whatever is left after ``deadline`` seconds is reported
    with :class:`LeakError`; leftover processes are then killed so the next test starts
    clean. Call :func:`warm_up` once before the first check.

    Examples:
        >>> from aioloader.testing import leak_check
        >>> with leak_check(deadline=5):
        ...     pass
    """
    baseline = LeakSnapshot.take(include_helpers)
    yield baseline
    try:
        check_leaks(baseline, deadline, include_helpers)
    except LeakError:
        for pid in LeakSnapshot.take(include_helpers).children - baseline.children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        raise


# -- local servers: an HTTP object store with fault injection, and moto S3 ---------------

from ._servers import (  # noqa: E402
    ObjectServer,
    S3Server,
    ServerStartError,
    expected_object,
    object_server,
    s3_server,
)

ServerStartError.__module__ = __name__  # tracebacks name it aioloader.testing.ServerStartError
__all__ += ["ObjectServer", "S3Server", "ServerStartError", "expected_object", "object_server",
            "s3_server"]
