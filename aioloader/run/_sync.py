"""The sync adapter: drives the async loader from plain code, each step on the loader's
:class:`~aioloader.run._portal.Portal`; it adds nothing of its own."""

from __future__ import annotations

import gc
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from .._loops import running_loop
from ..plane._staging import consumer_stream, handing_to
from ._backstop import backstop, drop_backstop
from ._epoch import Epoch
from ._portal import Portal


class SyncLoader:
    """``for batch in loader.sync(device)``: one epoch per ``for``, batches on ``device``.

    Examples:
        >>> import aioloader
        >>> loader = aioloader.DataLoader([1, 2, 3], batch_size=2, quiet=True)
        >>> [b.tolist() for b in loader.sync()]
        [[1, 2], [3]]
    """

    def __init__(self, portal: Portal, epoch: Callable[[], Epoch],
                 length: Callable[[], int], device: torch.device | None) -> None:
        self._portal = portal
        self._epoch = epoch
        self._length = length
        self.device = device

    def __len__(self) -> int:
        return self._length()

    def __iter__(self) -> Iterator[Any]:
        return SyncEpoch(self._portal, self._epoch(), self.device)


class SyncEpoch(Iterator[Any]):
    """One epoch through the portal. An iterator object, not a generator: an error from one
    batch leaves it usable, and the next ``next()`` gives the next batch, as torch's
    iterator does (issue 32). Dropped half-way, its epoch is closed (the backstop), as a
    generator's ``finally`` would."""

    def __init__(self, portal: Portal, epoch: Epoch,
                 device: torch.device | None) -> None:
        self._portal = portal
        self._epoch: Epoch | None = epoch
        self.device = device
        self._backstop = backstop(self, _dropped, portal, epoch)

    def __next__(self) -> Any:
        epoch = self._epoch
        if epoch is None:
            raise StopIteration
        try:
            return self._portal.call(_anext(epoch, consumer_stream(self.device)))
        except StopAsyncIteration:
            self.close()
            raise StopIteration from None
        except BaseException:
            if epoch.done:  # the error ended the epoch (its workers are stopped)
                # This frame stays in the error's traceback: hold nothing through it that
                # would keep the loader (its portal's loop) alive while the error is kept.
                self._epoch = None
                drop_backstop(self._backstop)
            del epoch
            raise

    def close(self) -> None:
        """Stop the epoch (its workers, unless they are kept), as a generator's close."""
        epoch, self._epoch = self._epoch, None
        if epoch is not None:
            drop_backstop(self._backstop)
            if running_loop() is not self._portal.loop:  # (never from inside a step)
                self._portal.call(epoch.aclose())


_COLLECTING = threading.local()  # .now: this thread is inside a garbage collection


def _collection(phase: str, info: dict[str, Any]) -> None:
    _COLLECTING.now = phase == "start"


gc.callbacks.append(_collection)


def _dropped(portal: Portal, epoch: Epoch) -> None:
    """The backstop of an epoch dropped half-way: closed (:meth:`Portal.hand`). Dropped by its
    last reference (a ``break``), it closes here, so that the workers are reaped when the loop
    is left, as torch's are. Collected, it closes from a thread of its own: a collection runs
    in whatever thread allocates, whatever locks it holds (an executor's ``submit`` holds
    concurrent.futures' global lock while the thread it starts collects), and a close there,
    which submits too, waited for that lock forever."""
    if running_loop() is portal.loop:  # not from inside a step (a GC there)
        return
    closing = epoch.aclose()
    if not getattr(_COLLECTING, "now", False):
        portal.hand(closing)
        return
    try:
        threading.Thread(target=portal.hand, args=(closing,), name="aioloader-dropped",
                         daemon=True).start()
    except RuntimeError:  # the interpreter is exiting: no new thread
        portal.hand(closing)


async def _anext(it: AsyncIterator[Any], stream: Any = None) -> Any:
    # The caller's CUDA stream, for a loop that runs in another thread (see _staging).
    handing_to.set(stream)
    return await it.__anext__()

