"""Instances to batches, the same code in a worker and in the main process."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._collate import default_collate
from ._loads import SkippedLoad
from ._position import PASS_START, BlockStart, Mark, Shard, ShardPosition
from ._samplers import Batcher, BatchSampler, Group


@dataclass(frozen=True)
class BatchOptions:
    """How instances are grouped: the loader's batching options, as data."""

    batch_size: int | None
    drop_last: bool
    shuffle: bool
    sampler: BatchSampler | None
    chunk_size: int | None  # max_instances_in_memory; None = the whole pass at once


class ShardPass:
    """One pass over one shard: instances in, batches out, each with its :data:`Mark`.

    The batcher cuts the pass into blocks; the start of each block (from ``shard.mark``) goes
    with the block's first batch, so that the consumer always knows a position to resume
    from. Resuming at ``start``, the batches of its block that were delivered already are
    dropped here, before anything is collated.
    """

    def __init__(self, shard: Shard, options: BatchOptions, seed: int,
                 start: ShardPosition | None = None) -> None:
        begin = start.start if start is not None else PASS_START
        self.shard = shard
        self.batcher = Batcher(batch_size=options.batch_size, drop_last=options.drop_last,
                               shuffle=options.shuffle, sampler=options.sampler,
                               chunk_size=options.chunk_size, seed=seed,
                               first_block=begin.block)
        self.taken = 0
        self.starts: dict[int, BlockStart] = {begin.block: begin}
        self._skip_block = begin.block
        self._skip = start.batches if start is not None else 0
        self.emitted = 0

    def feed(self, instance: Any) -> list[tuple[list[Any], Mark]]:
        self.taken += 1
        # A key skipped on error counts for the position, and has nothing to batch.
        groups = [] if isinstance(instance, SkippedLoad) else self.batcher.feed(instance)
        if self.batcher.filled == 0:  # a block closed (or has not begun): it starts here
            self.starts[self.batcher.block] = self.shard.mark(self.batcher.block, self.taken)
        return self._marked(groups) if groups else []

    def finish(self) -> list[tuple[list[Any], Mark]]:
        return self._marked(self.batcher.finish())

    def _marked(self, groups: list[Group]) -> list[tuple[list[Any], Mark]]:
        out = []
        for block, index, items in groups:
            if block == self._skip_block and index < self._skip:
                continue  # delivered before the resume
            start = self.starts.pop(block, None)
            out.append((items, [block, index, start.to_wire() if start is not None else None]))
        self.emitted += len(out)
        return out


def sync_batches(stream: Iterable[Any],
                 batcher: ShardPass) -> Iterator[tuple[list[Any], Mark]]:
    for instance in stream:
        yield from batcher.feed(instance)
    yield from batcher.finish()


def collate_with(collate_fn: Callable[[list[Any]], Any] | None) -> Callable[[list[Any]], Any]:
    return collate_fn if collate_fn is not None else default_collate
