"""A worker's exception as its parent gets it: its repr, its traceback, itself pickled.

A thread worker's parent is in the same process: it takes the exception itself from the
worker's :class:`~aioloader.plane._dataplane.Shelf` instead of a pickle.
"""

from __future__ import annotations

import pickle
import traceback

from ..plane._dataplane import Shelf


def described(exc: BaseException, shelf: Shelf | None,
              seq: int | None = None) -> tuple[str, str, bytes | None]:
    """``exc`` as the wire carries it; with ``shelf`` (a thread worker's), the exception
    is put there (by batch ``seq``, or as the worker's own) and not pickled."""
    pickled: bytes | None = None
    if shelf is None:
        pickled = pickled_error(exc)
    elif seq is None:
        shelf.error = exc
    else:
        shelf.errors[seq] = exc
    return repr(exc), traceback_text(exc), pickled


def pickled_error(exc: BaseException) -> bytes | None:
    """``exc`` pickled, if it survives the round trip; else what torch re-raises for it:
    its type made from its message alone (``type(exc)(message)``, its attributes left
    behind), or a ``RuntimeError`` where that type refuses one argument. None: the parent
    gets its text only."""
    for stand_in in (exc, _message_only(exc), RuntimeError(str(exc))):
        try:
            pickled = pickle.dumps(stand_in)
            pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - the next stand-in, or the text alone
            continue
        return pickled
    return None


def _message_only(exc: BaseException) -> BaseException | None:
    """``exc``'s type holding ``str(exc)`` and nothing else: it unpickles as
    ``type(exc)(str(exc))``, as torch's ExceptionWrapper rebuilds it."""
    try:
        bare = type(exc).__new__(type(exc))
        bare.args = (str(exc),)
    except Exception:  # noqa: BLE001 - a type that cannot be made so
        return None
    return bare


def traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
