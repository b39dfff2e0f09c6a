"""Samplers, ranks and scale as torch's DataLoader has them, on the same Dataset and seeds.

Each test compares with ``torch.utils.data.DataLoader`` where torch's answer is the measure.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, RandomSampler, Sampler

import aioloader

WORKERS = [(0, "process"), (2, "process"), (2, "thread")]


class Numbers(Dataset[int]):
    """range(n) as a torch Dataset."""

    def __init__(self, n: int) -> None:
        self.numbers = range(n)

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, i: int) -> int:
        return self.numbers[i]


class Endless(Sampler[int]):
    """detectron2's TrainingSampler pattern: an infinite generator of indices. It counts what
    it yielded, and refuses to go past `limit` (a loader that drew the whole epoch first
    would otherwise never give a batch)."""

    def __init__(self, n: int, limit: int) -> None:
        self.n, self.limit, self.drawn = n, limit, 0

    def __iter__(self) -> Iterator[int]:
        for i in itertools.count():
            if i >= self.limit:
                raise AssertionError(f"the loader drew {i} indices before the first batches")
            self.drawn = i + 1
            yield i % self.n


def _loader(*args: Any, workers: tuple[int, str], **kwargs: Any) -> aioloader.DataLoader:
    num_workers, worker_type = workers
    return aioloader.DataLoader(*args, num_workers=num_workers, worker_type=worker_type,
                                quiet=True, **kwargs)


@pytest.mark.parametrize("workers", WORKERS)
def test_an_endless_sampler_gives_batches_as_torch_does(workers: tuple[int, str]) -> None:
    sampler = Endless(10, limit=100_000)
    with _loader(Numbers(10), batch_size=4, sampler=sampler, workers=workers) as loader:
        got = [b.tolist() for b in itertools.islice(loader, 5)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    # Drawn as the batches are due (with some ahead), not the epoch first.
    assert sampler.drawn < 10_000


@pytest.mark.parametrize("workers", WORKERS)
def test_a_batch_sampler_of_millions_is_drawn_as_batches_are_due(
        workers: tuple[int, str]) -> None:
    sampler = Endless(3_000_000, limit=3_000_000)  # one finite epoch of 3 million
    batches = torch.utils.data.BatchSampler(sampler, 64, drop_last=False)
    with _loader(Numbers(3_000_000), batch_sampler=batches, workers=workers) as loader:
        first = next(iter(loader))
        assert sampler.drawn < 100_000
    assert first.tolist() == list(range(64))


def test_resume_skips_a_user_sampler_to_the_rest_of_its_epoch() -> None:
    def make() -> aioloader.DataLoader:
        gen = torch.Generator().manual_seed(3)
        return aioloader.DataLoader(Numbers(50), batch_size=4, num_workers=2, quiet=True,
                                    sampler=RandomSampler(Numbers(50), generator=gen))

    with make() as loader:
        whole = [b.tolist() for b in loader]
    with make() as loader:
        it = iter(loader)
        head = [next(it).tolist() for _ in range(5)]
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        rest = [b.tolist() for b in loader]
    assert head + rest == whole


class NoLength(Sampler[int]):
    """A sampler without __len__: torch iterates it; only len(loader) is a TypeError."""

    def __iter__(self) -> Iterator[int]:
        yield from [3, 1, 4, 1, 5, 9, 2, 6, 5]


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_sampler_without_len_iterates_as_in_torch(workers: tuple[int, str],
                                                    batch_size: int | None) -> None:
    # The epoch's start asked len(loader) for its progress bar and its end, and a sampler
    # without __len__ made that a TypeError in both faces.
    torch_loader = torch.utils.data.DataLoader(Numbers(10), batch_size=batch_size,
                                               sampler=NoLength())
    want = [torch.as_tensor(b).tolist() for b in torch_loader]
    assert want == ([3, 1, 4, 1, 5, 9, 2, 6, 5] if batch_size is None
                    else [[3, 1], [4, 1], [5, 9], [2, 6], [5]])

    async def consume(loader: aioloader.DataLoader) -> list[Any]:
        return [torch.as_tensor(b).tolist() async for b in loader]

    with _loader(Numbers(10), batch_size=batch_size, sampler=NoLength(),
                 workers=workers) as loader:
        for _ in range(2):
            assert [torch.as_tensor(b).tolist() for b in loader] == want
        assert asyncio.run(consume(loader)) == want
        with pytest.raises(TypeError):
            len(loader)


def _epochs_after_seed(make: Any, epochs: int = 3) -> tuple[list[list[list[int]]], float]:
    """The batches of ``epochs`` epochs after torch.manual_seed(5), and the next number of
    torch's default generator after them."""
    torch.manual_seed(5)
    loader = make()
    try:
        got = [[b.tolist() for b in loader] for _ in range(epochs)]
    finally:
        getattr(loader, "close", lambda: None)()
    return got, torch.rand(()).item()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_random_sampler_on_the_default_generator_follows_torch_every_epoch(
        workers: tuple[int, str], persistent: bool) -> None:
    """torch draws a base seed from the default generator per iterator (the first only with
    persistent workers); RandomSampler's own draw comes after it: epoch 2 differed here."""
    persistent = persistent and workers[0] > 0
    ds = Numbers(23)
    expected = _epochs_after_seed(lambda: torch.utils.data.DataLoader(
        ds, batch_size=4, sampler=RandomSampler(ds), num_workers=workers[0],
        persistent_workers=persistent))
    got = _epochs_after_seed(lambda: _loader(
        ds, batch_size=4, sampler=RandomSampler(ds), workers=workers,
        persistent_workers=persistent))
    assert got == expected


@pytest.mark.parametrize("workers", WORKERS)
def test_a_dataset_of_2_to_the_40_is_read_in_order_as_torch_reads_it(
        workers: tuple[int, str]) -> None:
    """torch's SequentialSampler is a range: O(1) whatever len(dataset). Here the plan was a
    torch.arange of 2**40 indices (8 TB): RuntimeError at the first batch."""
    with _loader(Numbers(2**40), batch_size=4, workers=workers) as loader:
        assert len(loader) == 2**38
        head = [b.tolist() for b in itertools.islice(loader, 3)]
    assert head == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_few_indices_of_a_huge_dataset_through_a_sampler(drop_last: bool) -> None:
    picks = [5, 2**40 - 1, 7]
    expected = [b.tolist() for b in torch.utils.data.DataLoader(
        Numbers(2**40), batch_size=2, drop_last=drop_last, sampler=picks)]
    with _loader(Numbers(2**40), batch_size=2, drop_last=drop_last, sampler=picks,
                 workers=(2, "process")) as loader:
        assert len(loader) == len(expected)
        assert [b.tolist() for b in loader] == expected
