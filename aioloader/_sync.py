"""The sync adapter: drives the async loader from plain code; it adds nothing of its own.

Each step runs on the loader's :class:`~aioloader._portal.Portal`, an event loop kept for the
loader's lifetime.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from ._loops import running_loop
from ._portal import Portal
from ._staging import consumer_stream, handing_to


class SyncLoader:
    """``for batch in loader.sync(device)``: one epoch per ``for``, batches on ``device``.

    Examples:
        >>> import aioloader
        >>> loader = aioloader.DataLoader([1, 2, 3], batch_size=2, quiet=True)
        >>> [b.tolist() for b in loader.sync()]
        [[1, 2], [3]]
    """

    def __init__(self, portal: Portal, epoch: Callable[[], AsyncIterator[Any]],
                 length: Callable[[], int], device: torch.device | None) -> None:
        self._portal = portal
        self._epoch = epoch
        self._length = length
        self.device = device

    def __len__(self) -> int:
        return self._length()

    def __iter__(self) -> Iterator[Any]:
        portal = self._portal
        epoch = self._epoch()
        try:
            while True:
                try:
                    batch = portal.call(_anext(epoch, consumer_stream(self.device)))
                except StopAsyncIteration:
                    return
                yield batch
        finally:
            if running_loop() is not portal.loop:  # not from inside a step (a GC there)
                portal.call(_aclose(epoch))


async def _anext(it: AsyncIterator[Any], stream: Any = None) -> Any:
    # The caller's CUDA stream, for a loop that runs in another thread (see _staging).
    handing_to.set(stream)
    return await it.__anext__()


async def _aclose(it: Any) -> None:
    await it.aclose()
