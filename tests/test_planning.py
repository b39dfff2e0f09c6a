"""Unit tests of aioloader.plans._planning: epoch plans are pure, cover the data, and shard by
policy."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler as TorchBatchSampler
from torch.utils.data import DistributedSampler, SequentialSampler

from aioloader.plans._distributed import shard_order, share_size
from aioloader.plans._planning import (
    PlanSpec,
    Sharding,
    count_batches,
    plan_epoch,
    sharding,
    worker_seed,
)
from aioloader.plans._samplers import (
    BucketBatchSampler,
    derive_seed,
    index_batches,
    torch_generator,
)

FAST = settings(max_examples=60, deadline=None)


def flat(plan: list[list[int]]) -> list[int]:
    return [i for batch in plan for i in batch]


def rank_plans(world: int, n: int, epoch: int = 0, **options: Any) -> list[list[list[int]]]:
    return [
        plan_epoch(PlanSpec(rank=r, world_size=world, **options), range(n), epoch, shared=True)
        for r in range(world)
    ]


# ------------------------------------------------------------------------------ one rank


@FAST
@given(
    n=st.integers(0, 300),
    batch_size=st.integers(1, 40),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    shared=st.booleans(),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
)
def test_single_rank_plan_is_a_permutation(
    n: int, batch_size: int, drop_last: bool, shuffle: bool, shared: bool, seed: int, epoch: int
) -> None:
    spec = PlanSpec(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed)
    plan = plan_epoch(spec, range(n), epoch, shared=shared)
    kept = n - n % batch_size if drop_last else n
    assert all(len(b) == batch_size for b in plan[:-1])
    assert not plan or 1 <= len(plan[-1]) <= batch_size
    if drop_last or not shuffle:
        assert len(flat(plan)) == kept
    if not shuffle:
        assert flat(plan) == list(range(kept))
    else:
        assert len(set(flat(plan))) == len(flat(plan)) and set(flat(plan)) <= set(range(n))
        if not drop_last:
            assert sorted(flat(plan)) == list(range(n))
    assert all(type(i) is int for i in flat(plan))


def test_a_plan_reproduces_for_a_seed_and_changes_with_epoch_and_seed() -> None:
    spec = PlanSpec(batch_size=7, shuffle=True, seed=11)
    epochs = [plan_epoch(spec, range(100), e, shared=True) for e in range(4)]
    assert epochs == [plan_epoch(spec, range(100), e, shared=True) for e in range(4)]
    assert len({str(p) for p in epochs}) == 4
    other = PlanSpec(batch_size=7, shuffle=True, seed=12)
    assert plan_epoch(other, range(100), 0, shared=True) != epochs[0]
    assert flat(epochs[0]) != list(range(100))


def test_the_shuffle_is_randperm_seeded_from_seed_and_epoch() -> None:
    spec = PlanSpec(batch_size=4, shuffle=True, seed=5)
    expected = index_batches(
        30, 4, drop_last=False, shuffle=True, rng=torch_generator(derive_seed(5, 3))
    )
    assert plan_epoch(spec, range(30), 3, shared=True) == expected
    assert plan_epoch(spec, range(30), 3, shared=False) == expected  # one rank: LOCAL == SPLIT


def test_a_plan_is_the_same_in_another_process() -> None:
    code = (
        "from aioloader.plans._planning import PlanSpec, plan_epoch\n"
        "spec = PlanSpec(batch_size=5, shuffle=True, seed=99, rank=1, world_size=3)\n"
        "print(plan_epoch(spec, range(103), 4, shared=True))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    spec = PlanSpec(batch_size=5, shuffle=True, seed=99, rank=1, world_size=3)
    assert out.stdout.strip() == str(plan_epoch(spec, range(103), 4, shared=True))


def test_plans_can_be_made_in_a_thread() -> None:
    spec = PlanSpec(batch_size=3, shuffle=True, seed=2)

    async def main() -> list[list[list[int]]]:
        return list(
            await asyncio.gather(
                *(asyncio.to_thread(plan_epoch, spec, range(50), e, shared=True) for e in (0, 1))
            )
        )

    assert asyncio.run(main()) == [plan_epoch(spec, range(50), e, shared=True) for e in (0, 1)]


def test_two_million_indices_are_shuffled_and_all_there() -> None:
    n = 2_000_000
    spec = PlanSpec(batch_size=32, shuffle=True, seed=3)
    plan = plan_epoch(spec, range(n), 0, shared=True)
    assert len(plan) == n // 32 == count_batches(spec, range(n), shared=True)
    order = torch.tensor(plan).flatten()  # every batch is full: 2M is a multiple of 32
    assert not torch.equal(order, torch.arange(n))
    assert torch.equal(order.sort().values, torch.arange(n))


# ------------------------------------------------------------------------------ ranks


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_the_loaders_own_sampling(world: int) -> None:
    for n, even, drop_last, shuffle in itertools.product(
        [0, 1, 2, 5, 31, 100], (False, True), (False, True), (False, True)
    ):
        check_split(world, n, even, drop_last, shuffle)


def check_split(world: int, n: int, even: bool, drop_last: bool, shuffle: bool) -> None:
    batch_size = 4
    plans = rank_plans(world, n, 1, batch_size=batch_size, drop_last=drop_last,
                       shuffle=shuffle, seed=8, even_batches=even)
    seen = Counter(i for plan in plans for i in flat(plan))
    assert set(seen) <= set(range(n))
    if even:
        per_rank = n // world if drop_last else -(-n // world)
        # each rank's share is per_rank samples, of which drop_last keeps whole batches
        kept = per_rank - per_rank % batch_size if drop_last else per_rank
        assert [len(flat(p)) for p in plans] == [kept] * world
        assert len({len(p) for p in plans}) == 1  # the same number of batches everywhere
        if not drop_last:
            assert set(seen) == set(range(n))  # wrapped: a few samples twice, none missing
            assert sum(seen.values()) - n == per_rank * world - n
    else:
        assert max(seen.values(), default=1) == 1  # disjoint
        if not drop_last:
            assert sorted(seen) == list(range(n))
    if even and drop_last:
        assert max(seen.values(), default=1) == 1


def test_ranks_deal_one_shuffled_order() -> None:
    plans = rank_plans(2, 10, 0, batch_size=10, shuffle=True, seed=4)
    order = torch.randperm(10, generator=torch_generator(derive_seed(4, 0))).tolist()
    assert [flat(p) for p in plans] == [order[0::2], order[1::2]]


@pytest.mark.parametrize("world", [2, 3])
def test_bucket_sampler_batches_its_ranks_share(world: int) -> None:
    instances = [{"tokens": "x" * (i * 37 % 23 + 1)} for i in range(101)]
    sampler = BucketBatchSampler(4, padding_noise=0.0)
    plans = [
        plan_epoch(PlanSpec(sampler=sampler, rank=r, world_size=world, seed=1), instances, 0,
                   shared=True)
        for r in range(world)
    ]
    seen = Counter(i for plan in plans for i in flat(plan))
    assert set(seen) == set(range(101))
    assert sum(seen.values()) == world * -(-101 // world)  # even_batches: wrapped
    for r, plan in enumerate(plans):
        share = shard_order(torch.arange(101), r, world, even=True, drop_last=False).tolist()
        assert sorted(flat(plan)) == sorted(share)
        # no noise: the batches are consecutive runs of the share sorted by length
        runs = sorted(sorted(len(instances[i]["tokens"]) for i in b) for b in plan)
        assert all(a[-1] <= b[0] for a, b in itertools.pairwise(runs))


def test_cached_instances_are_planned_whole_on_each_rank() -> None:
    specs = [PlanSpec(batch_size=3, shuffle=True, seed=6, rank=r, world_size=2) for r in (0, 1)]
    plans = [plan_epoch(spec, range(10), 0, shared=False) for spec in specs]
    for plan in plans:
        assert sorted(flat(plan)) == list(range(10))
    # each rank shuffles its own shard with its own stream: no lock-step across ranks
    assert plans[0] != plans[1]


def test_target_batches_pads_by_repeating_from_the_start() -> None:
    spec = PlanSpec(batch_size=4, rank=1, world_size=2)
    plan = plan_epoch(spec, range(9), 0, shared=False)
    assert plan == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    padded = plan_epoch(spec, range(9), 0, shared=False, target_batches=7)
    assert padded == [*plan, *plan, plan[0]]
    assert plan_epoch(spec, range(9), 0, shared=False, target_batches=2) == plan  # no truncation
    assert plan_epoch(spec, range(0), 0, shared=False, target_batches=3) == []


# ------------------------------------------------------------------------------ user samplers


@pytest.mark.parametrize("epoch", [0, 3])
def test_a_users_distributed_batch_sampler_is_used_as_is(epoch: int) -> None:
    dataset = range(240)
    plans = []
    for r in (0, 1):
        user = TorchBatchSampler(DistributedSampler(dataset, num_replicas=2, rank=r, seed=5),
                                 8, False)  # type: ignore[arg-type]
        spec = PlanSpec(sampler=user, rank=r, world_size=2, seed=1)
        user.sampler.set_epoch(epoch)  # type: ignore[attr-defined] - the user's job, as in torch
        plan = plan_epoch(spec, dataset, epoch, shared=True)
        assert plan == [list(b) for b in user]  # exactly what it yields: no re-dealing
        assert len(plan) == count_batches(spec, dataset, shared=True) == 15
        plans.append(plan)
    assert sorted(flat(plans[0]) + flat(plans[1])) == list(range(240))


def test_set_epoch_reshuffles_a_users_sampler() -> None:
    ds = range(50)
    user = TorchBatchSampler(DistributedSampler(ds, num_replicas=1, rank=0), 5, False)  # type: ignore[arg-type]
    spec = PlanSpec(sampler=user)
    first = plan_epoch(spec, ds, 0, shared=True)
    user.sampler.set_epoch(1)  # type: ignore[attr-defined]
    second = plan_epoch(spec, ds, 1, shared=True)
    assert first != second and second == plan_epoch(spec, ds, 1, shared=True)
    assert sorted(flat(first)) == sorted(flat(second)) == list(ds)


class Recording:
    """An iterable of index lists with its own set_epoch."""

    def __init__(self) -> None:
        self.epochs: list[int] = []
        self.sampler = SequentialSampler(range(4))  # its set_epoch-less child is not reached

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[3, 2], [1, 0]])


def test_the_loader_never_calls_a_users_set_epoch() -> None:
    # torch's rule: a script that resumes calls sampler.set_epoch(5) itself; the loader's
    # pass count must not undo it.
    user = Recording()
    spec = PlanSpec(sampler=user, rank=0, world_size=2)
    assert plan_epoch(spec, range(4), 7, shared=True) == [[3, 2], [1, 0]]
    assert user.epochs == []
    with pytest.raises(TypeError, match="no len"):
        count_batches(spec, range(4), shared=True)


def test_a_sampler_of_single_indices_is_refused_clearly() -> None:
    with pytest.raises(TypeError, match="not a list of indices"):
        plan_epoch(PlanSpec(sampler=SequentialSampler(range(3))), range(3), 0, shared=True)


# ------------------------------------------------------------------------------ counting


def _specs() -> Iterator[PlanSpec]:
    for world in (1, 2, 3):
        for rank, even, options in itertools.product(
            range(world),
            (False, True),
            [
                dict(batch_size=b, drop_last=d, shuffle=s)
                for b in (1, 4, 7)
                for d in (False, True)
                for s in (False, True)
            ]
            + [dict(sampler=BucketBatchSampler(4, drop_last=d)) for d in (False, True)],
        ):
            yield PlanSpec(rank=rank, world_size=world, even_batches=even, seed=3, **options)


@pytest.mark.parametrize("shared", [False, True])
def test_count_batches_is_the_plans_length(shared: bool) -> None:
    for n, spec in itertools.product([0, 1, 6, 23, 64], _specs()):
        instances = [{"tokens": [0] * (i % 5 + 1)} for i in range(n)]
        plan = plan_epoch(spec, instances, 2, shared=shared)
        assert count_batches(spec, instances, shared=shared) == len(plan), spec


def test_count_batches_does_not_touch_the_data() -> None:
    class Huge:
        def __len__(self) -> int:
            return 10**12

        def __getitem__(self, i: int) -> Any:
            raise AssertionError("read")

    spec = PlanSpec(batch_size=32, shuffle=True, rank=1, world_size=4, drop_last=True)
    assert count_batches(spec, Huge(), shared=True) == 10**12 // 4 // 32  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ pieces


def test_sharding_policy() -> None:
    assert sharding(PlanSpec(batch_size=2), shared=True) is Sharding.SPLIT
    assert sharding(PlanSpec(batch_size=2), shared=False) is Sharding.LOCAL
    assert sharding(PlanSpec(sampler=BucketBatchSampler(2)), shared=True) is Sharding.SPLIT
    assert sharding(PlanSpec(sampler=[[0, 1]]), shared=True) is Sharding.AS_IS


def test_seeds_keep_their_formulas() -> None:
    # seed 21, epoch 3, rank 1, worker 2
    assert worker_seed(21, 3, 1, 2) == derive_seed(21, 3, 1, 2) & (2**63 - 1)
    assert 0 <= worker_seed(21, 3, 1, 2) < 2**63


def _old_shard_indices(n: int, rank: int, world: int, even: bool, drop_last: bool) -> list[int]:
    order = list(range(n))
    if even and n % world:
        if drop_last:
            order = order[: n - n % world]
        else:
            pad = world - n % world
            order = order + (order * (pad // max(1, n) + 1))[:pad]
    return order[rank::world]


def test_shard_order_matches_the_list_version_and_share_size() -> None:
    for world, n, even, drop_last in itertools.product(
        [1, 2, 3, 7], [0, 1, 2, 6, 10, 13], (False, True), (False, True)
    ):
        for rank in range(world):
            check_shard(n, rank, world, even, drop_last)


def check_shard(n: int, rank: int, world: int, even: bool, drop_last: bool) -> None:
    expected = _old_shard_indices(n, rank, world, even, drop_last)
    got = shard_order(torch.arange(n), rank, world, even=even, drop_last=drop_last)
    assert got.tolist() == expected
    assert share_size(n, rank, world, even=even, drop_last=drop_last) == len(expected)
