"""A worker's spec pickled as spawn and forkserver send it, with the fds its reducers pass."""

from __future__ import annotations

import contextlib
import multiprocessing.context
import os
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._errors import SourcePicklingError

_RECEIVED: dict[int, int] = {}  # in a standby, while its spec is unpickled: index -> fd


def check_picklable(parts: dict[str, Any], start_method: str) -> None:
    """SourcePicklingError for the first of ``parts`` that spawn could not send."""
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
    """Spawn's ``Popen`` while a spec is pickled: collects the fds reducers pass."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1

    def DupFd(self, index: int) -> _PassedFd:  # multiprocessing calls it so
        return _PassedFd(index)


@dataclass(frozen=True)
class _PassedFd:
    """An fd sent with a spec, by its place among those that came with it."""

    index: int

    def detach(self) -> int:
        return _RECEIVED.pop(self.index)


@contextlib.contextmanager
def fds_passed(fds: list[int]) -> Iterator[None]:
    """While a spec sent with ``fds`` is unpickled (those not taken are closed after)."""
    _RECEIVED.update(enumerate(fds))
    try:
        yield
    finally:
        for fd in _RECEIVED.values():
            os.close(fd)
        _RECEIVED.clear()
