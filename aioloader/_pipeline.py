"""Instances to batches, the same code in a worker and in the main process."""

from __future__ import annotations

import random
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._collate import default_collate
from ._samplers import Batcher, BatchSampler, use_rng


@dataclass(frozen=True)
class BatchOptions:
    """How instances are grouped: the loader's batching options, as data."""

    batch_size: int | None
    drop_last: bool
    shuffle: bool
    sampler: BatchSampler | None
    chunk_size: int | None  # max_instances_in_memory; None = the whole pass at once


class PassBatcher:
    """A :class:`Batcher` for one pass whose randomness comes from its own seeded RNG.

    The RNG is installed around each call rather than for the whole pass, because a pass
    may be driven from several tasks or threads in turn (the sync adapter does that).
    """

    def __init__(self, options: BatchOptions, seed: int) -> None:
        self.rng = random.Random(seed)
        with use_rng(self.rng):
            self._batcher = Batcher(batch_size=options.batch_size, drop_last=options.drop_last,
                                    shuffle=options.shuffle, sampler=options.sampler,
                                    chunk_size=options.chunk_size)
        # Without a sampler the Batcher already holds its RNG: no context per instance.
        self._needs_rng = options.sampler is not None

    def feed(self, instance: Any) -> list[list[Any]]:
        if not self._needs_rng:
            return self._batcher.feed(instance)
        with use_rng(self.rng):
            return self._batcher.feed(instance)

    def finish(self) -> list[list[Any]]:
        with use_rng(self.rng):
            return self._batcher.finish()


def sync_batches(stream: Iterable[Any], batcher: PassBatcher) -> Iterator[list[Any]]:
    for instance in stream:
        yield from batcher.feed(instance)
    yield from batcher.finish()


async def async_batches(stream: AsyncIterable[Any],
                        batcher: PassBatcher) -> AsyncIterator[list[Any]]:
    async for instance in stream:
        for group in batcher.feed(instance):
            yield group
    for group in batcher.finish():
        yield group


def collate_with(collate_fn: Callable[[list[Any]], Any] | None) -> Callable[[list[Any]], Any]:
    return collate_fn if collate_fn is not None else default_collate
