"""Users' scripts about a loader's lifetime and its two faces (sync and async), each checked
against torch's DataLoader where torch has the same thing. The autouse leak check
(tests/conftest.py) finds nothing left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from core_sources import Squares
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Sampler

import aioloader


class Backwards(Sampler[int]):
    """A sampler with ``__iter__`` only, as torch allows: no ``__len__``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))


def indices(loader: Any) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_without_len_is_iterated_as_torch_iterates_it(num_workers: int) -> None:
    # The epoch's start asked len(loader) for its progress bar and its end, and a sampler
    # without __len__ made that a TypeError: torch iterates it, only len(loader) refuses.
    def loader(cls: Any) -> Any:
        return cls(Squares(10), batch_size=4, sampler=Backwards(10), num_workers=num_workers)

    want = indices(loader(TorchLoader))
    ours = loader(aioloader.DataLoader)
    assert want == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
    assert [indices(ours), indices(ours)] == [want, want]
    with pytest.raises(TypeError):
        len(ours)

    async def consume() -> list[list[int]]:
        return [b["index"].tolist() async for b in ours]

    assert asyncio.run(consume()) == want
