"""ordered=False resumes exactly once (issue 21).

Loads finish out of order, so a block says nothing about what was delivered: each batch
carries the numbers of the keys it holds (their place in the shard's stream), and a shard's
position is "every key before ``low``, and these after it". That set is bounded by what was
in flight (the load window, a block, the slots), never by the epoch.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

import pytest

import aioloader

N = 150
CONCURRENCY = 8
CHUNK = 16
BATCH = 4


class Jittery(aioloader.Reader):
    """Keys 0..n-1; a key's load takes a few turns of the loop, so later keys finish first."""

    def read(self, n: int) -> Any:
        yield from range(n)

    async def load(self, key: int) -> dict[str, Any]:
        for _ in range((key * 7919) % 7):
            await asyncio.sleep(0)
        return {"k": key, "text": "t" * (key % 5 + 1)}


def make(workers: int, shuffle: bool = True) -> aioloader.DataLoader:
    reader = Jittery()
    return aioloader.DataLoader(reader, N, batch_size=BATCH, shuffle=shuffle, seed=4,
                                num_workers=workers, max_instances_in_memory=CHUNK,
                                load_fn=reader.load, concurrency=CONCURRENCY,
                                ordered=False, quiet=True)


def keys(batch: Any) -> list[int]:
    return [int(k) for k in batch["k"]]


def cut(before: int, after: int, taken: int, shuffle: bool = True
        ) -> tuple[list[int], list[int], dict[str, Any]]:
    loader = make(before, shuffle)
    try:
        batches = iter(loader)
        first = [k for _ in range(taken) for k in keys(next(batches))]
        state = json.loads(json.dumps(loader.state_dict()))
    finally:
        loader.close()
    resumed = make(after, shuffle)
    try:
        resumed.load_state_dict(state)
        rest = [k for b in resumed for k in keys(b)]
    finally:
        resumed.close()
    return first, rest, state


@pytest.mark.parametrize(("before", "after"), [(0, 0), (2, 2), (2, 0), (0, 3), (2, 3)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_key_once_after_a_resume(before: int, after: int, shuffle: bool) -> None:
    first, rest, _ = cut(before, after, taken=9, shuffle=shuffle)
    assert collections.Counter(first + rest) == collections.Counter(range(N))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_state_is_bounded_by_what_was_in_flight(workers: int) -> None:
    first, _, state = cut(workers, workers, taken=20)
    shards = state["stream"]["shards"]
    # per shard: [pass, block, raw, state, batches, size, frontier, [low, *done]]
    held = [s[7] for s in shards]
    assert all(h is not None for h in held)
    assert sum(h[0] for h in held) <= len(first)  # every key before low was delivered
    slots = 4 * BATCH  # (prefetch slots per worker, at their most)
    for h in held:
        assert len(h) - 1 <= CONCURRENCY + CHUNK + slots, h
    size = len(json.dumps(state))
    in_flight = max(workers, 1) * (CONCURRENCY + CHUNK + slots)
    # a number is a few bytes: the state grows with what was in flight, not with the epoch
    assert size < 1500 + 8 * in_flight, (size, in_flight)


def test_a_cached_reader_with_ordered_false_resumes_exactly() -> None:
    """A cache fills in the keys' order (loads still overlap), so its epochs and their
    resume are those of ordered=True."""
    def cached(workers: int) -> aioloader.DataLoader:
        reader = Jittery()
        return aioloader.DataLoader(reader, 40, batch_size=BATCH, shuffle=True, seed=4,
                                    num_workers=workers, load_fn=reader.load,
                                    concurrency=CONCURRENCY, ordered=False, quiet=True)

    with cached(2) as loader:
        whole = [keys(b) for b in loader]
    with cached(2) as loader:
        batches = iter(loader)
        first = [keys(next(batches)) for _ in range(3)]
        state = loader.state_dict()
    with cached(0) as loader:
        loader.load_state_dict(state)
        rest = [keys(b) for b in loader]
    assert first + rest == whole


def test_a_batch_sampler_with_ordered_false_refuses_a_state() -> None:
    reader = Jittery()
    loader = aioloader.DataLoader(
        reader, 40, batch_sampler=aioloader.BucketBatchSampler(batch_size=4,
                                                               sorting_keys=["text"]),
        max_instances_in_memory=CHUNK, load_fn=reader.load, ordered=False, quiet=True)
    with loader:
        next(iter(loader))
        with pytest.raises(aioloader.ResumeError, match="BatchSampler"):
            loader.state_dict()


def test_epochs_of_batches_per_epoch_with_new_workers_each_go_on_from_the_keys() -> None:
    """persistent_workers=False: each epoch's workers start where the last epoch stopped."""
    reader = Jittery()
    loader = aioloader.DataLoader(reader, 40, batch_size=BATCH, seed=4, num_workers=2,
                                  max_instances_in_memory=CHUNK, load_fn=reader.load,
                                  concurrency=CONCURRENCY, ordered=False,
                                  batches_per_epoch=3, persistent_workers=False, quiet=True)
    with loader:
        seen = [k for _ in range(4) for b in loader for k in keys(b)]  # 48 > 40: a pass
    assert collections.Counter(seen[:40]) == collections.Counter(range(40))
