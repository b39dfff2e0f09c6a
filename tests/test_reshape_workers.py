"""A state taken with W workers resumed with W' (issue 21), on one rank.

Map-style and cached loaders give the batches of the uninterrupted run (their order does not
depend on workers). A lazy stream is read in one shard per worker, so with W' its rest is
read in W' new shards that skip what the old ones delivered: every instance once. A
property test draws the stream's shape (workers and ranks, before and after), its blocks,
shuffle and drop_last.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import threading
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_sources import AsyncReader, Items, StatefulReader, SyncReader, item

import aioloader
from aioloader import _config
from aioloader.plans._distributed import Topology

Make = Callable[[int], aioloader.DataLoader]


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["i"]]


def cut(make: Make, before: int, after: int, taken: int,
        epochs: int = 2) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Batches of ``make(before)`` up to ``taken``, then the rest of epoch 0 and ``epochs - 1``
    more epochs from ``make(after)`` resumed from its state (through JSON)."""
    loader = make(before)
    try:
        batches = iter(loader)
        first = [ids(next(batches)) for _ in range(taken)]
        state = json.loads(json.dumps(loader.state_dict()))
    finally:
        loader.close()
    resumed = make(after)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", aioloader.ResumeWarning)
            resumed.load_state_dict(state)
        rest = [[ids(b) for b in resumed] for _ in range(epochs)]
    finally:
        resumed.close()
    return first, rest


def whole(make: Make, workers: int, epochs: int = 2) -> list[list[list[int]]]:
    loader = make(workers)
    try:
        return [[ids(b) for b in loader] for _ in range(epochs)]
    finally:
        loader.close()


@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 3), (2, 1), (1, 4)])
@pytest.mark.parametrize("kind", ["map", "cached"])
def test_index_batches_are_those_of_the_uninterrupted_run(kind: str, before: int,
                                                          after: int) -> None:
    def make(workers: int) -> aioloader.DataLoader:
        source = Items(29) if kind == "map" else SyncReader(29)
        return aioloader.DataLoader(source, batch_size=3, shuffle=True, seed=5,
                                    num_workers=workers, quiet=True)

    first, rest = cut(make, before, after, taken=4)
    assert first + rest[0] == whole(make, before)[0]
    assert rest[1] == whole(make, after)[1]


READERS = {"sync": SyncReader, "async": AsyncReader, "stateful": StatefulReader}


@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_stream_gives_every_instance_once(reader: str, shuffle: bool, before: int,
                                            after: int) -> None:
    n = 47

    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(READERS[reader](n), batch_size=3, shuffle=shuffle, seed=2,
                                    num_workers=workers, max_instances_in_memory=6,
                                    quiet=True)

    first, rest = cut(make, before, after, taken=5)
    seen = collections.Counter(i for b in first + rest[0] for i in b)
    assert seen == collections.Counter(range(n))
    assert rest[1] == whole(make, after)[1]  # the next epoch is the new shape's own


Shape = tuple[int, int]  # (num_workers, world size)
SHAPES = st.tuples(st.integers(0, 3), st.integers(1, 2))
Loaders = list[aioloader.DataLoader[Any]]  # one per rank


def on_ranks(make: Callable[[], aioloader.DataLoader[Any]], world: int) -> Loaders:
    """``make()`` once per rank of ``world``, as that rank (in this process: without
    even_batches no collective is needed)."""
    loaders = []
    for rank in range(world):
        with mock.patch.object(_config, "topology", lambda even, rank=rank: Topology(rank, world)):
            loaders.append(make())
    return loaders


def rank_batches(loaders: Loaders, taken: list[int] | None = None,
                 states: list[Any] | None = None) -> tuple[list[list[list[int]]], list[Any]]:
    """Each rank's batches of one pass (``taken[r]`` of them, then its state through JSON),
    from ``states`` (every rank's at one step) when given."""
    batches, saved = [], []
    with contextlib.ExitStack() as stack:
        for loader in loaders:
            stack.callback(loader.close)
        for rank, loader in enumerate(loaders):
            if states is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", aioloader.ResumeWarning)
                    loader.load_state_dict(states)
            got = itertools.islice(loader, None if taken is None else taken[rank])
            batches.append([ids(b) for b in got])
            if taken is not None:
                saved.append(json.loads(json.dumps(loader.state_dict())))
    return batches, saved


@settings(max_examples=150, deadline=None)
@given(reader=st.sampled_from(list(READERS)), n=st.integers(1, 50), batch_size=st.integers(1, 5),
       room=st.integers(0, 10), shuffle=st.booleans(), drop_last=st.booleans(),
       before=SHAPES, after=st.one_of(SHAPES, st.none()), data=st.data())
def test_a_stream_resumed_on_any_shape_loses_and_repeats_nothing(
        reader: str, n: int, batch_size: int, room: int, shuffle: bool, drop_last: bool,
        before: Shape, after: Shape | None, data: st.DataObject) -> None:
    """On its own shape (``after`` None) the rest is the uninterrupted pass's, batch for batch;
    on another every instance once, but for drop_last's short batches: at most one per shard
    of either shape (an old shard's pass that ended before the state, each new shard's).
    A block is the whole batches that fit in ``batch_size + room`` instances."""
    new_shape = after or before

    def make(shape: Shape) -> Loaders:
        return on_ranks(lambda: aioloader.DataLoader(
            READERS[reader](n), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
            seed=2, num_workers=shape[0], worker_type="thread",
            max_instances_in_memory=batch_size + room, even_batches=False, quiet=True),
            shape[1])

    whole, _ = rank_batches(make(before))
    taken = [data.draw(st.integers(0, len(b)), label=f"taken[{r}]") for r, b in enumerate(whole)]
    first, states = rank_batches(make(before), taken)
    rest, _ = rank_batches(make(new_shape), states=states)
    if after is None:
        assert [f + r for f, r in zip(first, rest, strict=True)] == whole
        return
    batches = [b for part in first + rest for b in part]
    seen = collections.Counter(i for b in batches for i in b)
    assert max(seen.values(), default=1) == 1, "an instance was delivered twice"
    assert set(seen) <= set(range(n))
    if not drop_last:
        assert len(seen) == n
        return
    assert all(len(b) == batch_size for b in batches)
    shards = sum(max(workers, 1) * world for workers, world in (before, after))
    assert n - len(seen) <= shards * (batch_size - 1)


class PerThread(aioloader.Reader):
    """A stateful reader whose position is kept per reading thread (a block mark's state is
    its worker's, even in an object the workers share) and whose read starts at the state
    loaded last: thread workers sharing it start at one worker's state. A read begins once
    both workers' reads have (after both loaded their states)."""

    both_reading = threading.Barrier(2, timeout=30)  # (a class's: not copied)

    def __init__(self, n: int) -> None:
        self.n = n
        self._pos: dict[int, int] = {}
        self._load: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._pos.get(threading.get_ident(), 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load = int(state["next"])

    def read(self, data_path: Any) -> Any:
        self.both_reading.wait()
        start, self._load = self._load or 0, None
        for i in range(start, self.n):
            self._pos[threading.get_ident()] = i + 1
            yield item(i)


@pytest.mark.parametrize("taken", [6, 10])  # (both workers marked a block: both load)
def test_thread_workers_resume_a_stateful_reader_each_from_its_own_state(taken: int) -> None:
    """Each thread worker reads its own copy of a stateful reader, as a process does: a
    shared one loaded both workers' states into one place, and a worker resumed from the
    other's (instances lost and repeated: 0 passes in 40 runs of each on main)."""
    def make() -> Loaders:
        return [aioloader.DataLoader(PerThread(29), batch_size=1, num_workers=2,
                                     worker_type="thread", max_instances_in_memory=1,
                                     quiet=True)]

    whole, _ = rank_batches(make())
    first, states = rank_batches(make(), [taken])
    rest, _ = rank_batches(make(), states=states)
    assert whole == [[[i] for i in range(29)]]
    assert [first[0] + rest[0]] == whole


def test_a_stream_resumed_twice_on_new_shapes_within_one_epoch() -> None:
    n = 61

    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(SyncReader(n), batch_size=2, shuffle=True, seed=8,
                                    num_workers=workers, max_instances_in_memory=4,
                                    quiet=True)

    seen: list[int] = []
    state: Any = None
    for workers, taken in ((2, 3), (3, 4), (1, 2)):
        loader = make(workers)
        try:
            if state is not None:
                loader.load_state_dict(state)
            batches = iter(loader)
            seen += [i for _ in range(taken) for i in ids(next(batches))]
            state = json.loads(json.dumps(loader.state_dict()))
        finally:
            loader.close()
    last = make(0)
    try:
        last.load_state_dict(state)
        seen += [i for b in last for i in ids(b)]
    finally:
        last.close()
    assert collections.Counter(seen) == collections.Counter(range(n))


def test_a_stream_with_a_load_stage_resumed_with_other_workers() -> None:
    n = 40

    class Keys(aioloader.Reader):
        def read(self, data_path: Any) -> Any:
            yield from range(n)

    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(Keys(), batch_size=4, shuffle=True, seed=1,
                                    num_workers=workers, max_instances_in_memory=8,
                                    load_fn=lambda k: {"i": k}, concurrency=4, quiet=True)

    first, rest = cut(make, 2, 3, taken=3)
    assert collections.Counter(i for b in first + rest[0] for i in b) == collections.Counter(
        range(n))


def test_a_stream_that_splits_itself_is_refused_with_what_to_do() -> None:
    from resume_sources import Stream

    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(Stream(20), batch_size=2, num_workers=workers,
                                    max_instances_in_memory=4, quiet=True)

    loader = make(2)
    try:
        next(iter(loader))
        state = loader.state_dict()
    finally:
        loader.close()
    with pytest.raises(aioloader.ResumeError, match="splits itself"):
        make(1).load_state_dict(state)
    resumed = make(2)  # the same shape resumes
    try:
        resumed.load_state_dict(state)
    finally:
        resumed.close()


@pytest.mark.parametrize("loads", [False, True])
def test_recycled_workers_of_a_resumed_stream_keep_every_instance_once(loads: bool) -> None:
    """Workers retire every 2 batches (at a block boundary): each successor goes on from the
    resumed pass's position, what the old shape delivered still skipped."""
    n = 53

    class Keys(aioloader.Reader):
        def read(self, data_path: Any) -> Any:
            yield from range(n)

    def make(workers: int, recycle: int | None = None) -> aioloader.DataLoader:
        extra: dict[str, Any] = {"load_fn": lambda k: {"i": k}} if loads else {}
        source = Keys() if loads else SyncReader(n)
        return aioloader.DataLoader(source, batch_size=2, shuffle=True, seed=3,
                                    num_workers=workers, max_instances_in_memory=4,
                                    max_batches_per_worker=recycle, quiet=True, **extra)

    loader = make(3)
    try:
        batches = iter(loader)
        seen = [i for _ in range(5) for i in ids(next(batches))]
        state = json.loads(json.dumps(loader.state_dict()))
    finally:
        loader.close()
    resumed = make(2, recycle=2)
    try:
        resumed.load_state_dict(state)
        seen += [i for b in resumed for i in ids(b)]
        assert resumed.stats().recycles > 0
    finally:
        resumed.close()
    assert collections.Counter(seen) == collections.Counter(range(n))


def test_a_bucket_sampler_over_a_stream_on_a_new_shape_is_refused() -> None:
    def make(workers: int) -> aioloader.DataLoader:
        sampler = aioloader.BucketBatchSampler(batch_size=2, sorting_keys=["tokens"])
        return aioloader.DataLoader(SyncReader(30), batch_sampler=sampler,
                                    num_workers=workers, max_instances_in_memory=6,
                                    quiet=True)

    with make(2) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with pytest.raises(aioloader.ResumeError, match="BatchSampler's blocks depend"):
        make(1).load_state_dict(state)


def test_a_key_skipped_in_the_block_of_the_state_refuses_a_new_shape() -> None:
    """Its block's batches are not its first keys in a row, so a new shape could not tell
    them: refused, not guessed. The same shape still resumes (the block is read again)."""
    class Flaky(aioloader.Reader):
        def read(self, data_path: Any) -> Any:
            yield from range(40)

    def load(key: int) -> dict[str, int]:
        if key == 1:
            raise ValueError("a bad record")
        return {"i": key}

    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(Flaky(), batch_size=2, shuffle=True, seed=1,
                                    num_workers=workers, max_instances_in_memory=8,
                                    load_fn=load, on_error="skip", quiet=True)

    import logging
    logging.getLogger("aioloader").disabled = True
    try:
        with make(1) as loader:
            next(iter(loader))  # block 0 holds key 1, skipped
            state = loader.state_dict()
        with pytest.raises(aioloader.ResumeError, match="skipped on error"):
            make(2).load_state_dict(state)
        with make(1) as loader:
            loader.load_state_dict(state)
            assert 1 not in [i for b in loader for i in ids(b)]
    finally:
        logging.getLogger("aioloader").disabled = False


@pytest.mark.parametrize(("before", "after"), [(2, 3), (2, 0), (0, 2)])
def test_a_cached_iterable_dataset_that_splits_itself_is_refused_on_other_workers(
        before: int, after: int) -> None:
    """Its workers' instances are put back together one by one, which is its own order only
    if it splits itself one by one (test_reshape_gaps has one split in ranges): another
    num_workers is refused; the same one resumes exactly."""
    from resume_sources import Stream

    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(Stream(31), batch_size=3, shuffle=True, seed=6,
                                    num_workers=workers, quiet=True)

    with pytest.raises(aioloader.ResumeError, match="splits itself"):
        cut(make, before, after, taken=4)
    first, rest = cut(make, before, before, taken=4)
    assert first + rest[0] == whole(make, before)[0]
