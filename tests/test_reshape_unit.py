"""What an epoch interrupted on R ranks leaves for R' ranks (issue 21): pure, no process.

Every rank's plan is a pure function of (seed, epoch, rank, world size), so these tests play
the ranks of both runs in one process: the R ranks of the first run deliver some batches
each, their progress is put together, and the R' ranks of the second run plan the rest.
"""

from __future__ import annotations

import collections
from dataclasses import replace
from typing import Any

import pytest

from aioloader import BucketBatchSampler, ResumeError
from aioloader.plans._planning import PlanSpec, global_order, plan_epoch
from aioloader.plans._reshape import Progress, held, local_plan, split_plan


def flat(batches: Any) -> list[int]:
    return [i for b in batches for i in b]


def first_run(spec: PlanSpec, data: Any, epoch: int, world: int,
              taken: list[int]) -> list[int]:
    """The samples ranks 0..world-1 delivered, taking ``taken[r]`` batches each."""
    out: list[int] = []
    for r in range(world):
        plan = plan_epoch(replace(spec, rank=r, world_size=world), data, epoch, shared=True)
        out += flat(plan[: taken[r]])
    return out


CASES = [  # n, batch, shuffle, drop_last, R, taken per rank, R'
    (37, 3, True, False, 2, [4, 4], 1),
    (37, 3, True, False, 2, [4, 4], 4),
    (37, 3, False, False, 2, [5, 3], 3),
    (100, 8, True, True, 4, [2, 2, 2, 2], 2),
    (1000, 7, True, False, 3, [10, 11, 10], 5),
    (10, 4, True, False, 2, [0, 0], 1),
    (12, 3, True, False, 2, [2, 2], 3),  # nothing is left
    (13, 3, True, False, 2, [2, 2], 3),  # one sample is left, for three ranks
]


@pytest.mark.parametrize(("n", "batch", "shuffle", "drop_last", "world", "taken", "new"), CASES)
def test_split_every_sample_once_and_the_global_order_goes_on(
        n: int, batch: int, shuffle: bool, drop_last: bool, world: int, taken: list[int],
        new: int) -> None:
    data = range(n)
    spec = PlanSpec(batch_size=batch, shuffle=shuffle, drop_last=drop_last, seed=5)
    delivered = first_run(spec, data, 2, world, taken)
    history = (Progress(world, tuple(taken)),)
    rest = [flat(split_plan(replace(spec, rank=r, world_size=new), data, 2, history))
            for r in range(new)]
    seen = collections.Counter(delivered + [i for part in rest for i in part])
    left = [i for i in global_order(spec, n, 2).tolist() if i not in set(delivered)]
    if drop_last:  # the tail the new dealing leaves out is within one step of the ranks
        assert set(seen) <= set(range(n))
        assert n - len(set(seen)) < new * batch + world
    else:
        assert set(seen) == set(range(n))
    # Padding (even_batches) repeats a few samples at the very end of a pass, never earlier.
    assert sum(c - 1 for c in seen.values()) < new + world
    # The global order goes on: rank r's k-th sample is the (k * R' + r)-th of what is left.
    for r, part in enumerate(rest):
        assert part[: len(left[r::new])] == left[r::new][: len(part)]


def test_a_single_rank_resumed_on_one_rank_is_the_uninterrupted_order() -> None:
    data, spec = range(50), PlanSpec(batch_size=4, shuffle=True, seed=1)
    whole = flat(plan_epoch(spec, data, 0, shared=True))
    rest = flat(split_plan(spec, data, 0, (Progress(1, (5,)),)))
    assert whole[:20] + rest == whole


def test_split_twice_reshaped_in_one_epoch() -> None:
    """2 ranks -> 3 ranks -> 1 rank, all in the same epoch."""
    n, data = 61, range(61)
    spec = PlanSpec(batch_size=2, shuffle=True, seed=9, even_batches=False)
    delivered = first_run(spec, data, 0, 2, [3, 3])
    first = (Progress(2, (3, 3)),)
    for r in range(3):
        plan = split_plan(replace(spec, rank=r, world_size=3), data, 0, first)
        delivered += flat(plan[:2])
    second = (*first, Progress(3, (2, 2, 2)))
    rest = flat(split_plan(spec, data, 0, second))
    assert sorted(delivered + rest) == list(range(n))


def test_split_with_a_bucket_sampler() -> None:
    lengths = [i % 11 + 1 for i in range(90)]
    data = [{"tokens": ["t"] * k} for k in lengths]
    spec = PlanSpec(sampler=BucketBatchSampler(batch_size=4, sorting_keys=["tokens"]), seed=3)
    delivered = first_run(spec, data, 1, 2, [3, 3])
    rest = [flat(split_plan(replace(spec, rank=r, world_size=4), data, 1,
                            (Progress(2, (3, 3)),))) for r in range(4)]
    seen = delivered + [i for part in rest for i in part]
    assert set(seen) == set(range(90))
    assert len(seen) - 90 < 8  # only even_batches' padding repeats


def local_first_run(spec: PlanSpec, total: int, world: int, group: int,
                    taken: list[int]) -> list[int]:
    """Raw instances delivered by ranks each caching their ``group`` shards."""
    out: list[int] = []
    caches = [held(total, r, world, group).tolist() for r in range(world)]
    target = max(-(-len(c) // spec.batch_size) for c in caches) if world > 1 else None
    for r in range(world):
        plan = plan_epoch(replace(spec, rank=r, world_size=world), caches[r], 0,
                          shared=False, target_batches=target)
        out += [caches[r][i] for i in flat(plan[: taken[r]])]
    return out


def test_a_rank_caches_its_workers_shards_in_the_readers_order() -> None:
    assert held(10, 0, 2, 2).tolist() == [0, 1, 4, 5, 8, 9]
    assert held(10, 1, 2, 2).tolist() == [2, 3, 6, 7]
    assert held(7, 1, 3, 1).tolist() == [1, 4]


@pytest.mark.parametrize(("total", "world", "group", "taken", "new", "new_group"), [
    (41, 2, 1, [4, 4], 1, 1), (41, 2, 2, [4, 4], 4, 1), (40, 4, 1, [1, 2, 3, 2], 2, 3),
    (7, 2, 1, [1, 1], 3, 1), (41, 2, 2, [4, 4], 2, 1)])
def test_local_every_instance_once(total: int, world: int, group: int, taken: list[int],
                                   new: int, new_group: int) -> None:
    spec = PlanSpec(batch_size=3, shuffle=True, seed=4)
    delivered = local_first_run(spec, total, world, group, taken)
    counts = tuple(len(held(total, r, world, group)) for r in range(world))
    history = (Progress(world, tuple(taken), counts, group),)
    rest: list[int] = []
    lengths = []
    for r in range(new):
        cache = held(total, r, new, new_group).tolist()
        plan = local_plan(replace(spec, rank=r, world_size=new), 0, history, len(cache),
                          new_group)
        lengths.append(len(plan))
        rest += [cache[i] for i in flat(plan)]  # cache index -> raw instance
    seen = collections.Counter(delivered + rest)
    assert set(seen) == set(range(total))
    assert len(set(lengths)) == 1  # even_batches: the new ranks agree on the count
    assert sum(c - 1 for c in seen.values()) <= new * spec.batch_size  # even_batches' pad


def test_local_refuses_a_cache_that_does_not_match_the_states() -> None:
    spec = PlanSpec(batch_size=3, seed=4)
    history = (Progress(2, (1, 1), (20, 20)),)
    with pytest.raises(ResumeError, match="should hold 40, but the reader gave it 39"):
        local_plan(spec, 0, history, 39, 1)


def test_a_progress_past_a_ranks_epoch_is_refused() -> None:
    spec = PlanSpec(batch_size=3, seed=4)
    with pytest.raises(ResumeError, match="100 batches of epoch 0 were delivered"):
        split_plan(spec, range(30), 0, (Progress(2, (100, 1)),))


@pytest.mark.parametrize("bad", [[2, [1], None, 1], [0, [], None, 1], [2, [1, -1], None, 1],
                                 [2, [1, 1], [3], 1], [2, [1, 1], None, 0], [1, [1], None]])
def test_a_corrupt_progress_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        Progress.from_data(bad)


def test_millions_of_indices() -> None:
    n, data = 2_000_000, range(2_000_000)
    spec = PlanSpec(batch_size=256, shuffle=True, seed=0)
    plan = split_plan(replace(spec, rank=1, world_size=3), data, 0,
                      (Progress(2, (1000, 1000)),))
    assert len(plan) == -(-(n - 512_000) // 3 // 256)
