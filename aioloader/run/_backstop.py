"""The garbage collector's backstop for what nobody closed: ``weakref.finalize``, dropped in
forked children (a loader collected there must never touch its parent's workers)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

# Every pending backstop of this process. A forked child drops them all (register_at_fork
# below), so that a loader collected there never touches the parent's workers (issue 9).
_BACKSTOPS: set[weakref.finalize[Any, Any]] = set()


def backstop(obj: object, fn: Callable[..., None], *args: Any) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(obj, fn, *args)``, dropped in forked children."""
    holder: list[weakref.finalize[Any, Any]] = []

    def run() -> None:
        _BACKSTOPS.discard(holder[0])
        fn(*args)

    finalizer = weakref.finalize(obj, run)
    holder.append(finalizer)
    _BACKSTOPS.add(finalizer)
    return finalizer


def drop_backstop(finalizer: weakref.finalize[Any, Any]) -> None:
    finalizer.detach()
    _BACKSTOPS.discard(finalizer)


def _forget_backstops_in_child() -> None:
    for finalizer in list(_BACKSTOPS):
        finalizer.detach()
    _BACKSTOPS.clear()


os.register_at_fork(after_in_child=_forget_backstops_in_child)
