"""Unit tests of aioloader.plans._samplers: index plans, shuffles, Batcher, BucketBatchSampler,
seeds."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader.plans._batcher import Batcher, Group
from aioloader.plans._samplers import (
    Batches,
    BatchSampler,
    BucketBatchSampler,
    current_rng,
    derive_seed,
    index_batches,
    num_batches,
    torch_generator,
    use_rng,
)

FAST = settings(max_examples=60, deadline=None)

# ------------------------------------------------------------------------------ seeds


def test_derive_seed_is_stable_and_64_bit() -> None:
    assert derive_seed(0) == derive_seed(0)
    assert derive_seed(1234, 3, 0, 7) == derive_seed(1234, 3, 0, 7)
    # pinned: must not change between runs, processes or versions (no Python hash())
    assert derive_seed(0, 1, 2) == 0xD56DADBFED1E6C9D
    for args in [(0,), (2**70, -5), (-1, 0, 1)]:
        assert 0 <= derive_seed(*args) < 2**64


def test_derive_seed_streams_are_distinct() -> None:
    seeds = {
        derive_seed(base, epoch, rank, worker)
        for base in (0, 1, 42)
        for epoch in range(5)
        for rank in range(3)
        for worker in range(4)
    }
    assert len(seeds) == 3 * 5 * 3 * 4
    # unambiguous packing: neither concatenation nor argument count collide
    assert derive_seed(1, 23) != derive_seed(12, 3)
    assert derive_seed(1) != derive_seed(1, 0)
    assert derive_seed(0, -1) != derive_seed(0, 255)


def test_derive_seed_is_the_same_in_another_process() -> None:
    import subprocess
    import sys

    code = "from aioloader.plans._samplers import derive_seed; print(derive_seed(7, 1, 2, 3))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert int(out.stdout) == derive_seed(7, 1, 2, 3)


# ------------------------------------------------------------------------------ rng context


def test_use_rng_sets_and_restores_current_rng() -> None:
    default = current_rng()
    mine = random.Random(3)
    with use_rng(mine):
        assert current_rng() is mine
        with use_rng(random.Random(4)):
            assert current_rng() is not mine
        assert current_rng() is mine
    assert current_rng() is default


# ------------------------------------------------------------------------------ index plans


@FAST
@given(
    n=st.integers(0, 200),
    batch_size=st.integers(1, 30),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_index_batches_properties(
    n: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int
) -> None:
    batches = index_batches(
        n, batch_size, drop_last=drop_last, shuffle=shuffle, rng=random.Random(seed)
    )
    assert len(batches) == num_batches(n, batch_size, drop_last)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    kept = n - n % batch_size if drop_last else n
    assert len(flat) == kept
    assert all(len(b) == batch_size for b in batches[:-1])
    if batches:
        assert 1 <= len(batches[-1]) <= batch_size
        assert not drop_last or len(batches[-1]) == batch_size
    if not shuffle:
        assert flat == list(range(kept))
    else:
        assert set(flat) <= set(range(n))
        if not drop_last:
            assert sorted(flat) == list(range(n))


def test_index_batches_shuffles_reproducibly() -> None:
    a = index_batches(50, 7, drop_last=False, shuffle=True, rng=random.Random(1))
    b = index_batches(50, 7, drop_last=False, shuffle=True, rng=random.Random(1))
    c = index_batches(50, 7, drop_last=False, shuffle=True, rng=random.Random(2))
    assert a == b and a != c


def test_index_batches_shuffles_with_randperm() -> None:
    expected = torch.randperm(20, generator=torch_generator(7)).tolist()
    got = index_batches(20, 6, drop_last=False, shuffle=True, rng=torch_generator(7))
    assert [i for b in got for i in b] == expected
    # a random.Random seeds the torch generator with 64 of its bits
    bits = random.Random(3).getrandbits(64)
    assert index_batches(20, 6, drop_last=True, shuffle=True, rng=random.Random(3)) == (
        index_batches(20, 6, drop_last=True, shuffle=True, rng=torch_generator(bits))
    )


def test_batches_cut_an_index_tensor() -> None:
    assert Batches(torch.arange(7), 3, False) == [[0, 1, 2], [3, 4, 5], [6]]
    assert Batches(torch.arange(7), 3, True) == [[0, 1, 2], [3, 4, 5]]
    assert Batches(torch.arange(10)[1::2], 2, False) == [[1, 3], [5, 7], [9]]
    assert Batches(torch.arange(2), 3, True) == []
    assert Batches(torch.arange(0), 3, False) == []


def test_num_batches() -> None:
    assert num_batches(10, 3, False) == 4 and num_batches(10, 3, True) == 3
    assert num_batches(0, 3, False) == 0


# ------------------------------------------------------------------------------ Batcher


class Counted:
    """Wraps an iterable and counts how many items were pulled from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.pulled += 1
            yield i


class EveryOther(BatchSampler):
    """Pairs of indices, odd ones first, with a random order: to see that chunks are honoured."""

    def get_batch_indices(self, instances: Sequence[Any]) -> list[list[int]]:
        order = list(range(1, len(instances), 2)) + list(range(0, len(instances), 2))
        batches = [order[i : i + 2] for i in range(0, len(order), 2)]
        current_rng().shuffle(batches)
        return batches

    def get_num_batches(self, instances: Sequence[Any]) -> int:
        return -(-len(instances) // 2)


def feed_all(batcher: Batcher, items: Any) -> list[list[Any]]:
    return [group.items for group in feed_groups(batcher, items)]


def feed_groups(batcher: Batcher, items: Any) -> list[Group]:
    out: list[Group] = []
    for item in items:
        out += batcher.feed(item)
    return out + batcher.finish()


@FAST
@given(
    n=st.integers(0, 120),
    batch_size=st.integers(1, 12),
    extra=st.integers(0, 30),
    cached=st.booleans(),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_batcher_without_sampler_cuts_across_the_stream(
    n: int,
    batch_size: int,
    extra: int,
    cached: bool,
    drop_last: bool,
    shuffle: bool,
    seed: int,
) -> None:
    chunk_size = None if cached else batch_size + extra
    with use_rng(random.Random(seed)):
        batcher = Batcher(
            batch_size=batch_size,
            drop_last=drop_last,
            shuffle=shuffle,
            sampler=None,
            chunk_size=chunk_size,
        )
    source = Counted(n)
    batches: list[list[int]] = []
    emitted = 0
    for item in source:
        new = [group.items for group in batcher.feed(item)]
        batches += new
        emitted += sum(len(b) for b in new)
        if chunk_size is not None:
            assert source.pulled - emitted <= max(chunk_size, batch_size)
    batches += [group.items for group in batcher.finish()]
    assert len(batches) == num_batches(n, batch_size, drop_last)
    assert all(len(b) == batch_size for b in batches[:-1])
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)) == (n - n % batch_size if drop_last else n)
    if not shuffle:
        assert flat == list(range(len(flat)))


def test_batcher_chunked_shuffle_mixes_and_reproduces() -> None:
    def run(seed: int) -> list[list[int]]:
        with use_rng(random.Random(seed)):
            b = Batcher(batch_size=4, drop_last=False, shuffle=True, sampler=None, chunk_size=16)
        return feed_all(b, range(100))

    assert run(1) == run(1) and run(1) != run(2)
    assert [i for b in run(1) for i in b] != list(range(100))


@FAST
@given(n=st.integers(0, 60), chunk=st.one_of(st.none(), st.integers(1, 25)))
def test_batcher_with_sampler_applies_it_per_chunk(n: int, chunk: int | None) -> None:
    with use_rng(random.Random(0)):
        batcher = Batcher(
            batch_size=None, drop_last=False, shuffle=False, sampler=EveryOther(), chunk_size=chunk
        )
    source = Counted(n)
    batches: list[list[int]] = []
    for item in source:
        batches += [group.items for group in batcher.feed(item)]
        if chunk is not None:
            assert source.pulled - sum(len(b) for b in batches) <= chunk
    batches += [group.items for group in batcher.finish()]
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(n))
    size = chunk or max(n, 1)
    for b in batches:  # a batch never spans two chunks
        assert len({i // size for i in b}) == 1


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("use_sampler", [False, True])
def test_batcher_agrees_with_index_batches(
    shuffle: bool, drop_last: bool, use_sampler: bool
) -> None:
    """A whole pass is one block: planned as index_batches plans it, with block 0's rng."""
    instances = [{"text": "x" * (i * 7 % 13), "i": i} for i in range(53)]
    if use_sampler:
        sampler: BatchSampler | None = BucketBatchSampler(5, drop_last=drop_last)
        options: dict[str, Any] = dict(batch_size=None, drop_last=False, shuffle=False)
    else:
        sampler = None
        options = dict(batch_size=5, drop_last=drop_last, shuffle=shuffle)
    for seed in range(3):
        block_rng = random.Random(derive_seed(seed, 0))
        plan = index_batches(instances, sampler=sampler, rng=block_rng, **options)
        batcher = Batcher(sampler=sampler, chunk_size=None, seed=seed, **options)
        got = feed_all(batcher, instances)
        assert got == [[instances[i] for i in b] for b in plan]


def test_batcher_takes_its_seed_at_construction_and_is_reusable() -> None:
    with use_rng(random.Random(9)):
        batcher = Batcher(
            batch_size=3, drop_last=False, shuffle=True, sampler=None, chunk_size=None
        )
    seed = random.Random(9).getrandbits(64)
    first = feed_all(batcher, range(10))  # outside use_rng: still the seed it was built with
    second = feed_all(batcher, range(10))
    expected = index_batches(10, 3, drop_last=False, shuffle=True,
                             rng=random.Random(derive_seed(seed, 0)))
    assert first == second == expected


@FAST
@given(
    n=st.integers(0, 90),
    batch_size=st.integers(1, 7),
    extra=st.integers(0, 12),
    mode=st.sampled_from(["stream", "shuffle", "sampler"]),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_a_pass_resumed_at_any_block_start_gives_the_rest_of_the_same_batches(
    n: int, batch_size: int, extra: int, mode: str, drop_last: bool, seed: int
) -> None:
    """Issue 10: a block's batches depend on its instances and its number only, so feeding
    the instances from a block's start on, numbered from that block, repeats the tail."""
    options: dict[str, Any] = dict(batch_size=batch_size, drop_last=drop_last,
                                   shuffle=mode == "shuffle", sampler=None)
    if mode == "sampler":
        options = dict(batch_size=None, drop_last=False, shuffle=False,
                       sampler=BucketBatchSampler(batch_size, ["text"], drop_last=drop_last))
    chunk = batch_size + extra
    items = [{"text": "x" * (i * 5 % 11), "i": i} for i in range(n)]
    whole = feed_groups(Batcher(chunk_size=chunk, seed=seed, **options), items)
    probe = Batcher(chunk_size=chunk, seed=seed, **options)
    starts = [0]  # the instances taken before each block starts
    for taken, item in enumerate(items, 1):
        probe.feed(item)
        if probe.filled == 0:
            starts.append(taken)
    for block, start in enumerate(starts):
        tail = feed_groups(Batcher(chunk_size=chunk, seed=seed, first_block=block, **options),
                           items[start:])
        assert tail == [g for g in whole if g.block >= block]


def test_batch_sampler_base() -> None:
    base = BatchSampler()
    assert base.get_batch_size() is None
    with pytest.raises(NotImplementedError):
        base.get_batch_indices([1])
    with pytest.raises(NotImplementedError):
        base.get_num_batches([1])


# ------------------------------------------------------------------------------ buckets


def lengths_of(instances: Sequence[dict[str, Any]], batch: list[int], key: str) -> list[int]:
    return [len(instances[i][key]) for i in batch]


@FAST
@given(
    lengths=st.lists(st.integers(0, 40), max_size=80),
    batch_size=st.integers(1, 10),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_bucket_without_noise_batches_sorted_length_groups(
    lengths: list[int], batch_size: int, drop_last: bool, seed: int
) -> None:
    instances = [{"tokens": [0] * n, "label": 1} for n in lengths]
    sampler = BucketBatchSampler(batch_size, ["tokens"], padding_noise=0.0, drop_last=drop_last)
    with use_rng(random.Random(seed)):
        batches = sampler.get_batch_indices(instances)
    assert len(batches) == sampler.get_num_batches(instances)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    # sorting the batches by their shortest member gives the sorted lengths, cut in groups
    ordered = sorted(batches, key=lambda b: (min(lengths_of(instances, b, "tokens")), b))
    got = [sorted(lengths_of(instances, b, "tokens")) for b in ordered]
    groups = [sorted(lengths)[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    if drop_last and groups and len(groups[-1]) < batch_size:
        groups.pop()
    assert sorted(got) == sorted(groups)


def test_bucket_noise_varies_equal_lengths_and_reproduces() -> None:
    instances = [{"tokens": [0] * (i % 4)} for i in range(64)]
    sampler = BucketBatchSampler(4, padding_noise=0.5)

    def run(k: int) -> list[list[int]]:
        with use_rng(random.Random(k)):
            return sampler.get_batch_indices(instances)

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert sorted(map(sorted, run(1))) != sorted(map(sorted, run(2)))  # grouping varies too
    spread = [
        max(lengths_of(instances, b, "tokens")) - min(lengths_of(instances, b, "tokens"))
        for b in run(1)
    ]
    assert sum(spread) < len(spread) * 2  # still mostly similar lengths


def test_bucket_guesses_the_longest_field() -> None:
    instances = [{"label": 1, "short": "ab", "long": list(range(i + 10))} for i in range(8)]
    sampler = BucketBatchSampler(2, padding_noise=0.0)
    with use_rng(random.Random(0)):
        batches = sampler.get_batch_indices(instances[::-1])
    assert sorted(map(sorted, batches)) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@dataclass
class Obj:
    words: torch.Tensor
    feats: np.ndarray


def test_bucket_reads_attributes_tensors_and_arrays() -> None:
    instances = [Obj(torch.zeros(i % 5 + 4, 2), np.zeros((3,))) for i in range(10)]
    sampler = BucketBatchSampler(2, padding_noise=0.0)
    with use_rng(random.Random(0)):
        batches = sampler.get_batch_indices(instances)
    for b in batches:
        assert len({instances[i].words.shape[0] for i in b}) == 1
    assert BucketBatchSampler(2, ["feats"]).get_batch_size() == 2


def test_bucket_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        BucketBatchSampler(0)
    with pytest.raises(ValueError, match="padding_noise"):
        BucketBatchSampler(2, padding_noise=-0.1)
    with pytest.raises(ValueError, match="list of field names"):
        BucketBatchSampler(2, sorting_keys="tokens")
    with pytest.raises(ValueError, match="has no field 'nope'"):
        BucketBatchSampler(2, ["nope"]).get_batch_indices([{"tokens": [1]}])
    with pytest.raises(ValueError, match="field 'n' of instance 0 is a int, which has no length"):
        BucketBatchSampler(2, ["n"]).get_batch_indices([{"n": 3}])
    with pytest.raises(ValueError, match="cannot guess sorting_keys"):
        BucketBatchSampler(2).get_batch_indices([{"n": 3, "t": torch.tensor(1.0)}])
    assert BucketBatchSampler(2).get_batch_indices([]) == []
