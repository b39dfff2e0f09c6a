"""Gaps that torch's own test/test_dataloader.py showed (issue 32), each checked against
torch's DataLoader on the same data in the same test."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch._utils import ExceptionWrapper
from torch.utils.data.datapipes.iter import IterableWrapper

import aioloader

pytestmark = pytest.mark.deadline(120)
LOADERS = [tud.DataLoader, aioloader.DataLoader]


def _run(loader: Any) -> list[Any]:
    try:
        return [b.tolist() if isinstance(b, torch.Tensor) else b for b in loader]
    finally:
        if isinstance(loader, aioloader.DataLoader):
            loader.close()


@pytest.mark.parametrize("shuffle", [1, 0, np.int64(1)])
def test_an_int_shuffle_counts_by_its_truth_as_torchs(shuffle: Any) -> None:
    # torch tests `if shuffle:`; a script passing shuffle=1 shuffles with both
    outcomes = []
    for loader in LOADERS:
        torch.manual_seed(0)
        batches = _run(loader(range(30), batch_size=30, shuffle=shuffle))
        outcomes.append(batches[0] != list(range(30)))
        assert sorted(batches[0]) == list(range(30))
    assert outcomes[1] == outcomes[0] == bool(shuffle)


def test_an_int_shuffle_with_a_sampler_is_refused_as_torchs() -> None:
    for loader in LOADERS:
        with pytest.raises(ValueError, match="sampler option is mutually exclusive with "
                                             "shuffle"):
            loader(range(4), sampler=range(4), shuffle=3)


def _row_plus_one(row: Any) -> Any:
    return np.add(row, 1)


def _four_long(row: Any) -> bool:
    return len(row) == 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterdatapipe_with_shuffle_streams_as_torchs(num_workers: int) -> None:
    # torch gives shuffle to the datapipe's own Shuffler nodes and streams it (each worker
    # its own batches); ours read it into memory and shuffled it whole, one batch of two
    # rows where torch gives two batches of one (test_multiprocessing_iterdatapipe).
    def pipe() -> Any:
        return IterableWrapper([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]).map(
            _row_plus_one).filter(_four_long)

    theirs, ours = (_run(loader(pipe(), batch_size=2, shuffle=True, num_workers=num_workers))
                    for loader in LOADERS)
    assert ours == theirs


def test_a_datapipes_shufflers_follow_shuffle_as_torchs() -> None:
    # shuffle=False turns a datapipe's Shuffler off, as torch's graph settings do
    def pipe() -> Any:
        return IterableWrapper(list(range(50))).shuffle()

    theirs, ours = (_run(loader(pipe(), batch_size=None, shuffle=False)) for loader in LOADERS)
    assert ours == theirs == list(range(50))


def test_a_dead_workers_error_is_rebuilt_from_its_message_as_torchs() -> None:
    # torch's ExceptionWrapper (and `type(err)(str(err))`) rebuild an exception from its
    # message alone; a WorkerDied needed three arguments, so torch's own test_segfault got a
    # TypeError instead of the RuntimeError that torch's dead-worker error rebuilds to.
    for error in (RuntimeError("DataLoader worker (pid 12) is killed by signal: "),
                  aioloader.WorkerDied(0, 12, -11)):
        try:
            raise error
        except RuntimeError:
            wrapped = ExceptionWrapper(sys.exc_info())
        rebuilt = wrapped.exc_type(wrapped.exc_msg)
        assert isinstance(rebuilt, RuntimeError)
        assert "(pid 12)" in str(rebuilt)
        with pytest.raises(type(error)):
            wrapped.reraise()


@pytest.mark.parametrize("batch_size", [None, 3])
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_a_datapipes_sharding_filter_splits_it_between_workers_as_torchs(
        num_workers: int, batch_size: int | None) -> None:
    # torch's workers apply the datapipe's sharding; ours read it whole in every worker,
    # each instance num_workers times
    theirs, ours = (
        _run(loader(IterableWrapper(list(range(10))).sharding_filter(), batch_size=batch_size,
                    num_workers=num_workers))
        for loader in LOADERS)
    assert ours == theirs


def test_thread_workers_refuse_a_datapipe_at_construction() -> None:
    # a datapipe allows one iterator at a time: two thread workers sharing it failed with
    # torch's "iterator has been invalidated" from inside the epoch
    pipe = IterableWrapper(list(range(10))).sharding_filter()
    with pytest.raises(ValueError, match="worker_type='process'"):
        aioloader.DataLoader(pipe, batch_size=None, num_workers=2, worker_type="thread")
    loader = aioloader.DataLoader(pipe, batch_size=None, num_workers=1, worker_type="thread")
    try:
        assert [int(i) for i in loader] == list(range(10))
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [2, 3])
def test_a_datapipe_shuffled_before_its_sharding_filter_is_partitioned_as_torchs(
        num_workers: int) -> None:
    # torch seeds every worker's Shuffler from one shared seed per iterator, so the shards
    # partition one shuffled order; ours drew a seed per worker: overlaps and misses
    def pipe() -> Any:
        return IterableWrapper(list(range(40))).shuffle().sharding_filter()

    theirs = tud.DataLoader(pipe(), batch_size=None, shuffle=True, num_workers=num_workers)
    ours = aioloader.DataLoader(pipe(), batch_size=None, shuffle=True, num_workers=num_workers,
                                persistent_workers=True)
    try:
        for loader in (theirs, ours):
            epochs = [[int(i) for i in loader] for _ in range(2)]
            assert [sorted(e) for e in epochs] == [list(range(40))] * 2, type(loader)
            assert epochs[0] != list(range(40)) and epochs[0] != epochs[1], type(loader)
    finally:
        ours.close()


class _Flaky(tud.IterableDataset[int]):
    """Worker k streams k * 100 + i for i < 7; worker 0's iterator raises ValueError at its
    pulls 1 (mid-batch) and 4. A class's iterator goes on after raising; a generator
    (``generator=True``) is over once it raised."""

    def __init__(self, generator: bool = False) -> None:
        self.generator = generator

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        it = _FlakyIterator(info.id if info is not None else 0)
        return (x for x in it) if self.generator else it


class _FlakyIterator:
    def __init__(self, worker: int) -> None:
        self.worker, self.pulls, self.given = worker, 0, 0

    def __iter__(self) -> _FlakyIterator:
        return self

    def __next__(self) -> int:
        self.pulls += 1
        if self.worker == 0 and self.pulls - 1 in (1, 4):
            raise ValueError(f"bad pull {self.pulls - 1}")
        if self.given == 7:
            raise StopIteration
        self.given += 1
        return self.worker * 100 + self.given - 1


def _failing_at_102(items: list[int]) -> Any:
    if 102 in items:
        raise ValueError("bad pull: the collate")
    return torch.tensor(items)


def _outcomes(step: Any, *, stop: type[BaseException] = StopIteration,
              until_error: bool = False) -> list[Any]:
    """What a loop that goes on after each error sees: batches, and "ValueError" for an
    error (of ValueError's type, the worker's message kept) in its place."""
    got: list[Any] = []
    while True:
        try:
            got.append(step().tolist())
        except stop:
            return got
        except ValueError as err:
            assert "bad pull" in str(err), repr(err)
            got.append("ValueError")
            if until_error:
                return got


async def _async_outcomes(loader: aioloader.DataLoader) -> list[Any]:
    it = aiter(loader)
    loop = asyncio.get_running_loop()

    def step() -> Any:
        return asyncio.run_coroutine_threadsafe(anext(it), loop).result()

    try:
        return await asyncio.to_thread(_outcomes, step, stop=StopAsyncIteration)
    finally:
        await loader.aclose()


@pytest.mark.parametrize("face", ["for", "async for"])
@pytest.mark.parametrize("generator", [False, True])
def test_a_streams_error_is_one_batchs_and_its_epoch_goes_on_as_torchs(
        generator: bool, face: str) -> None:
    # torch's worker sends the exception in that batch's place and goes on: next() raises
    # it, then the other workers' batches come (and the raising worker's, if its iterator
    # goes on); ours ended the epoch at the error (issue 32)
    theirs = _outcomes(iter(tud.DataLoader(_Flaky(generator), batch_size=2,
                                           num_workers=2)).__next__)
    ours_loader = aioloader.DataLoader(_Flaky(generator), batch_size=2, num_workers=2)
    if face == "for":
        ours = _outcomes(iter(ours_loader).__next__)
        ours_loader.close()
    else:
        ours = asyncio.run(_async_outcomes(ours_loader))
    assert ours == theirs
    assert theirs == (["ValueError", [100, 101], [102, 103], [104, 105], [106]] if generator
                      else ["ValueError", [100, 101], [1, 2], [102, 103], "ValueError",
                            [104, 105], [3, 4], [106], [5, 6]])


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_streams_collate_error_is_one_batchs_as_torchs(worker_type: str) -> None:
    theirs, ours = (_outcomes(iter(loader).__next__) for loader in (
        tud.DataLoader(_Flaky(), batch_size=2, num_workers=2, collate_fn=_failing_at_102),
        aioloader.DataLoader(_Flaky(), batch_size=2, num_workers=2,
                             collate_fn=_failing_at_102, worker_type=worker_type)))
    assert ours == theirs
    assert theirs.count("ValueError") == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_taken_after_a_streams_error_resumes_where_torch_goes_on(
        num_workers: int) -> None:
    # the failed batch counts as handed over: the position after it is exactly-once
    theirs = _outcomes(iter(tud.DataLoader(_Flaky(), batch_size=2,
                                           num_workers=num_workers)).__next__)
    first = aioloader.DataLoader(_Flaky(), batch_size=2, num_workers=num_workers)
    with first:
        seen = _outcomes(iter(first).__next__, until_error=True)
        state = first.state_dict()
    resumed = aioloader.DataLoader(_Flaky(), batch_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    with resumed:
        rest = _outcomes(iter(resumed).__next__)
    assert seen + rest == theirs


def _log_init(path: str, worker_id: int) -> None:
    with open(path, "a") as log:
        log.write(f"{os.getpid()} {worker_id}\n")


class _Ranges(tud.IterableDataset[int]):
    """Worker k streams k * 100 .. k * 100 + 9, anew for each iter()."""

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        k = info.id if info is not None else 0
        return iter(range(k * 100, k * 100 + 10))


def _three_left_early_then_whole(loader_type: Any, log: str, **options: Any) -> list[Any]:
    """Three epochs broken after 2 batches, then a whole one, on persistent workers."""
    loader = loader_type(_Ranges(), batch_size=2, num_workers=2, persistent_workers=True,
                         worker_init_fn=functools.partial(_log_init, log), **options)
    try:
        firsts = []
        for _ in range(3):
            for k, batch in enumerate(loader):
                firsts.append(batch.tolist())
                if k == 1:
                    break
        return [firsts, [batch.tolist() for batch in loader]]
    finally:
        if isinstance(loader, aioloader.DataLoader):
            loader.close()


def _broken_epochs_of_both(tmp_path: Any, theirs: dict[str, Any],
                           ours: dict[str, Any]) -> list[list[Any]]:
    """:func:`_three_left_early_then_whole` with torch's loader (``theirs``: its options)
    and ours, each with its count of ``worker_init_fn`` calls."""
    outcomes = []
    for loader_type, options in ((tud.DataLoader, theirs), (aioloader.DataLoader, ours)):
        log = tmp_path / f"{loader_type.__module__}.log"
        log.touch()
        got = _three_left_early_then_whole(loader_type, str(log), **options)
        outcomes.append([*got, len(log.read_text().splitlines())])
    return outcomes


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_persistent_workers_start_a_stream_again_after_an_epoch_left_early_as_torchs(
        tmp_path: Any, worker_type: str) -> None:
    # torch keeps the processes (worker_init_fn once per worker), each calls iter(dataset)
    # again and the abandoned epoch's batches are dropped; ours restarted the stream's
    # workers, worker_init_fn and all (issue 32)
    theirs, ours = _broken_epochs_of_both(tmp_path, {}, {"worker_type": worker_type})
    assert ours == theirs
    assert theirs[2] == 2
