"""Cutting a stream's pass into batches: blocks, each seeded by its number so that a pass
resumes at any block; pure, no I/O."""

from __future__ import annotations

import random
from typing import Any, NamedTuple

from ._samplers import BatchSampler, current_rng, derive_seed, index_batches


class Group(NamedTuple):
    """One batch of instances, and where it lies in its pass: batch number ``batch`` of
    block ``block`` (see :class:`Batcher`)."""

    block: int
    batch: int
    items: list[Any]
    size: int | None = None  # the block's instances, when it was planned whole (not streamed)


class Batcher:
    """Turns a stream of instances into batches, push-style, for sync and async loops alike.

    The stream is cut into blocks of `chunk_size` instances (None: the pass is one block;
    without a sampler, rounded down to whole batches), each shuffled or given to the sampler
    with a generator seeded from (`seed`, block number), so that a pass resumes at any block
    (issue 10); without either, batches stream out as they fill. `seed` None draws one from
    `current_rng()`; `first_block` numbers the first block (a resumed pass).

    Examples:
        for instance in stream:
            for group in batcher.feed(instance):
                yield group.items
        yield from (group.items for group in batcher.finish())
    """

    def __init__(
        self,
        *,
        batch_size: int | None,
        drop_last: bool,
        shuffle: bool,
        sampler: BatchSampler | None,
        chunk_size: int | None,
        seed: int | None = None,
        first_block: int = 0,
    ) -> None:
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._sampler = sampler
        self._seed = current_rng().getrandbits(64) if seed is None else seed
        if chunk_size is None or sampler is not None:
            self._capacity = chunk_size
        else:
            assert batch_size is not None
            self._capacity = max(chunk_size // batch_size, 1) * batch_size
        self.streams = sampler is None and not shuffle  # batches go out as they fill
        self._first_block = first_block
        self.block = first_block  # the block the next instance goes into
        self.filled = 0  # instances in that block so far
        self._pending: list[Any] = []  # the block's instances (sampler or shuffle)
        self._batch: list[Any] = []  # the batch being filled (streaming)
        self._index = 0  # batches of the block given out (streaming)

    def feed(self, instance: Any) -> list[Group]:
        """Take one instance; return the batches it completes (often none)."""
        self.filled += 1
        if self.streams:
            self._batch.append(instance)
            out = [self._streamed()] if len(self._batch) == self._batch_size else []
        else:
            self._pending.append(instance)
            out = self._close_block() if self.filled == self._capacity else []
        if self.filled == self._capacity:
            self._next_block()
        return out

    def fail(self) -> Group:
        """The batch being filled failed (the source raised while it was due): its
        instances are dropped and the failure is that batch, as torch's IterableDataset
        fetcher drops what it had of a batch that raised. It takes the rest of the batch's
        room, so that a block stays whole batches. Streaming only."""
        assert self.streams and self._batch_size is not None, "a block is cut whole"
        self.filled += self._batch_size - len(self._batch)
        self._batch = []
        failed = self._streamed()
        if self.filled == self._capacity:
            self._next_block()
        return failed

    def finish(self) -> list[Group]:
        """The remaining batches of this pass; resets for the next one."""
        if self.streams:
            out = [self._streamed()] if self._batch and not self._drop_last else []
        else:
            out = self._close_block(last=True) if self._pending else []
        self._batch, self._pending = [], []
        self.block, self.filled, self._index = self._first_block, 0, 0
        return out

    def _next_block(self) -> None:
        self.block += 1
        self.filled = 0
        self._index = 0

    def _streamed(self) -> Group:
        batch, self._batch = self._batch, []
        self._index += 1
        return Group(self.block, self._index - 1, batch)

    def _close_block(self, last: bool = False) -> list[Group]:
        chunk, self._pending = self._pending, []
        plan = index_batches(chunk, self._batch_size, drop_last=self._drop_last and last,
                             shuffle=self._sampler is None, sampler=self._sampler,
                             rng=random.Random(derive_seed(self._seed, self.block)))
        return [Group(self.block, k, [chunk[i] for i in b], len(chunk))
                for k, b in enumerate(plan)]
