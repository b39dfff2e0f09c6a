"""WorkerInfo and get_worker_info(): who am I, inside a worker (a process, or a thread)."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker knows about itself; ``aioloader.get_worker_info()`` returns it.

    Examples:
        >>> info = WorkerInfo(num_workers=2, id=1, seed=7, rank=0, world_size=1)
        >>> info.id
        1
    """

    num_workers: int
    id: int
    seed: int
    rank: int = 0
    world_size: int = 1


_current: WorkerInfo | None = None  # a worker process's: the whole process is the worker

# A thread worker's (ours, torch's), in its own context: the thread's tasks and its
# ``asyncio.to_thread`` calls inherit it; the main thread and other threads see None.
_in_thread: contextvars.ContextVar[tuple[WorkerInfo, Any] | None] = contextvars.ContextVar(
    "aioloader_worker_info", default=None)


def get_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of this worker, or ``None`` outside workers (the main thread
    of the main process included, while thread workers run)."""
    pair = _in_thread.get()
    return _current if pair is None else pair[0]


def set_worker_info(info: WorkerInfo | None, dataset: Any = None, *,
                    thread: bool = False) -> None:
    """Install ``info`` for this worker, for aioloader and for torch's own API.

    torch has no public setter: ``torch.utils.data.get_worker_info()`` reads a module global,
    which is what torch's own workers set. Setting it lets IterableDatasets that shard
    themselves the torch way (HuggingFace, WebDataset) work unchanged. A thread worker
    (``thread=True``) must not touch that global, which the whole process shares: its info
    lives in its own context, and :data:`TORCH_INFO_PER_THREAD` makes torch read it there.
    """
    global _current
    from torch.utils.data._utils import worker as torch_worker

    theirs = None if info is None else torch_worker.WorkerInfo(
        id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=dataset)
    if thread:
        _in_thread.set(None if info is None else (info, theirs))
        return
    _current = info
    torch_worker._worker_info = theirs


class Patch:
    """A change to torch in this process, made only while some scope needs it.

    ``apply()`` makes the change and returns what undoes it. The first :meth:`scope` to
    begin applies it, the last to end undoes it (counted, thread-safe), so torch is exactly
    itself again once no scope is left: a thread worker's lifetime is such a scope (see
    ``_threads.ThreadWorker``). A worker process changes its own torch for good:
    that process is ours.
    """

    def __init__(self, apply: Callable[[], Callable[[], None]]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._users = 0
        self._undo: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return self._undo is not None

    def scope(self) -> Patch:
        """A scope that needs the change: ``with patch.scope(): ...`` (nests, any thread).

        The patch is its own context manager: a scope begins once a batch in this process
        (``num_workers=0``), and a generator-based one costs five calls more each time."""
        return self

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                self._undo = self._apply()
            self._users += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._users -= 1
            undo = self._undo if self._users == 0 else None
            if undo is not None:
                self._undo = None
                undo()


# torch.utils.data.get_worker_info() is ``return _worker_info``: a module global, shared by
# every thread. Users import the function itself (``from torch.utils.data import
# get_worker_info``), so replacing the module attribute would miss them; swapping the
# function's code reaches every reference. The code runs with torch's module as its
# globals, where the patch puts our context variable.
_PER_THREAD_SOURCE = """
def get_worker_info():
    pair = _aioloader_thread_info.get()
    return _worker_info if pair is None else pair[1]
"""


def _torch_info_per_thread() -> Callable[[], None]:
    from torch.utils.data._utils import worker as torch_worker

    target = torch_worker.get_worker_info
    namespace: dict[str, Any] = {}
    exec(compile(_PER_THREAD_SOURCE, "<aioloader thread worker info>", "exec"), namespace)
    torch_worker.__dict__["_aioloader_thread_info"] = _in_thread
    original, ours = target.__code__, namespace["get_worker_info"].__code__
    target.__code__ = ours

    def undo() -> None:
        # The module's variable stays: a call in another thread may be inside our code now.
        if target.__code__ is ours:  # not if someone changed it since
            target.__code__ = original

    return undo


# While thread workers exist: torch.utils.data.get_worker_info() answers per thread.
TORCH_INFO_PER_THREAD = Patch(_torch_info_per_thread)
