"""WorkerInfo and get_worker_info(): who am I, inside a worker (a process, or a thread)."""

from __future__ import annotations

import contextvars
import threading
import types
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
    lives in its own context, and :func:`hook_torch` makes torch read it there.
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


# torch.utils.data.get_worker_info() is ``return _worker_info``: a module global, shared by
# every thread. Users import the function itself (``from torch.utils.data import
# get_worker_info``), so replacing the module attribute would miss them; swapping the
# function's code reaches every reference. The code runs with torch's module as its
# globals, where hook_torch puts our context variable.
_HOOK_SOURCE = """
def get_worker_info():
    pair = _aioloader_thread_info.get()
    return _worker_info if pair is None else pair[1]
"""
_hook_lock = threading.Lock()
_hook_users = 0
_torch_code: types.CodeType | None = None


def hook_torch(install: bool) -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer per thread (``install``), or undo
    it once the last thread worker is gone (``install=False``); counted, thread-safe."""
    global _hook_users, _torch_code
    from torch.utils.data._utils import worker as torch_worker

    target = torch_worker.get_worker_info
    with _hook_lock:
        _hook_users += 1 if install else -1
        if install and _hook_users == 1:
            namespace: dict[str, Any] = {}
            exec(compile(_HOOK_SOURCE, "<aioloader thread worker info>", "exec"), namespace)
            torch_worker.__dict__["_aioloader_thread_info"] = _in_thread
            _torch_code = target.__code__
            target.__code__ = namespace["get_worker_info"].__code__
        elif not install and _hook_users == 0 and _torch_code is not None:
            target.__code__ = _torch_code
            _torch_code = None
