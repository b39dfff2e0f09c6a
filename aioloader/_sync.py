"""The sync adapter: drives the async loader from plain code; it adds nothing of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._loader import DataLoader


class SyncLoader:
    """``for batch in loader.sync(device)``: one epoch per ``for``, batches on ``device``.

    Examples:
        >>> import aioloader
        >>> loader = aioloader.DataLoader([1, 2, 3], batch_size=2, quiet=True)
        >>> [b.tolist() for b in loader.sync()]
        [[1, 2], [3]]
    """

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self.loader = loader
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        call = self.loader._portal().call
        epoch = self.loader._iterate(self.device)
        try:
            while True:
                try:
                    batch = call(_anext(epoch))
                except StopAsyncIteration:
                    return
                yield batch
        finally:
            call(epoch.aclose())


async def _anext(it: AsyncIterator[Any]) -> Any:
    return await it.__anext__()
