"""Gaps that torch's own test/test_dataloader.py showed (issue 32), each checked against
torch's DataLoader on the same data in the same test."""

from __future__ import annotations

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
