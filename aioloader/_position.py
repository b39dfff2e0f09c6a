"""Where a pass over a streaming source stands: block starts and shard positions, as data.

A shard's pass is cut into blocks (see ``_samplers.Batcher``); a block's batches depend only
on its instances and its number. So a shard's position is the start of a block (how many
raw instances came before it, and the source's own ``state_dict()`` there) plus how many of
the block's batches were delivered. Resuming reopens the source at the block start (O(1)
when the source has ``load_state_dict``, otherwise by skipping) and drops the delivered
batches before they are collated (issue 10).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from ._sources import Kind, is_async, open_pass, shard_spec


@dataclass(frozen=True, slots=True)
class BlockStart:
    """Block ``block`` of a pass begins after ``raw`` instances of the source's stream (the
    whole stream, before the loader's sharding); ``state`` is the source's ``state_dict()``
    there (None: the pass's start, or a source without one)."""

    block: int
    raw: int
    state: Any = None

    def to_wire(self) -> list[Any]:
        return [self.block, self.raw, self.state]

    @classmethod
    def from_wire(cls, data: list[Any]) -> BlockStart:
        return cls(*data)


PASS_START = BlockStart(0, 0, None)


@dataclass(frozen=True, slots=True)
class ShardPosition:
    """A shard stands in pass ``pass_no``, ``batches`` batches into the block at ``start``."""

    pass_no: int
    start: BlockStart = PASS_START
    batches: int = 0

    def to_data(self) -> list[Any]:
        return [self.pass_no, *self.start.to_wire(), self.batches]

    @classmethod
    def from_data(cls, data: list[Any]) -> ShardPosition:
        pass_no, block, raw, state, batches = data
        return cls(pass_no, BlockStart(block, raw, state), batches)


Mark = list[Any]  # [block, index, start or None]: where a batch lies, sent with it


class ShardTracker:
    """The consumer's side of one shard: its position after the batches handed over."""

    def __init__(self, position: ShardPosition) -> None:
        self.position = position

    def delivered(self, mark: Mark) -> None:
        block, index, start = mark
        begin = BlockStart.from_wire(start) if start is not None else self.position.start
        if begin.block != block:
            raise AssertionError(f"batch {index} of block {block} arrived without the "
                                 f"block's start (position {self.position})")
        self.position = ShardPosition(self.position.pass_no, begin, index + 1)

    def ended(self) -> None:
        self.position = ShardPosition(self.position.pass_no + 1)


def is_stateful(source: Any) -> bool:
    """The source saves and restores its own position (torchdata's Stateful protocol)."""
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None))


class Shard:
    """This process's shard of one pass over a streaming source, from a block start on.

    The loader's sharding keeps raw positions ``index, index + count, ...``; the raw
    position after the k-th instance taken is therefore arithmetic, and only the source's
    own state needs asking for at a block start.
    """

    def __init__(self, source: Any, kind: Kind, data_path: Any, worker: int,
                 num_workers: int, rank: int, world_size: int,
                 start: BlockStart = PASS_START, *, keys: bool = False) -> None:
        self.index, self.count = shard_spec(source, kind, worker, num_workers, rank,
                                            world_size)
        # A stream of keys (a load stage follows) runs ahead of the instances loaded: the
        # source's own state would be ahead too. Keys are cheap to skip; raw counts suffice.
        self._stateful = source if is_stateful(source) and not keys else None
        self.base = start.raw
        self.first = self.base + (self.index - self.base) % self.count  # first raw kept
        skip = self.base
        if start.state is not None:
            if self._stateful is None:
                raise ValueError(f"the state holds a position of {type(source).__name__}'s "
                                 "own, but it has no load_state_dict()")
            self._stateful.load_state_dict(start.state)
            skip = 0
        self.skipped = skip  # instances read again and dropped to get back to the start
        self.stream = _from(open_pass(source, kind, data_path), skip + self.first - self.base,
                            self.count)

    def mark(self, block: int, taken: int) -> BlockStart:
        """The start of block ``block``, which follows the ``taken``-th instance taken."""
        raw = self.first + (taken - 1) * self.count + 1 if taken else self.base
        state = None
        if self._stateful is not None:
            state = self._stateful.state_dict()
            _check_json(state, self._stateful)
        return BlockStart(block, raw, state)


def _from(stream: Iterable[Any] | AsyncIterable[Any], first: int,
          step: int) -> Iterable[Any] | AsyncIterable[Any]:
    """Items ``first, first + step, ...`` of ``stream`` (the stream itself when (0, 1))."""
    if first == 0 and step == 1:
        return stream
    if is_async(stream):
        return _afrom(stream, first, step)  # type: ignore[arg-type]
    return itertools.islice(stream, first, None, step)  # type: ignore[arg-type]


async def _afrom(stream: AsyncIterable[Any], first: int, step: int) -> AsyncIterator[Any]:
    pos = -first
    async for item in stream:
        if pos >= 0 and pos % step == 0:
            yield item
        pos += 1


def _check_json(state: Any, source: Any) -> None:
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{type(source).__name__}.state_dict() returned {state!r}, which is "
                        f"not JSON data ({exc}): a reader's state must be plain dicts, "
                        "lists, strings and numbers, so that it fits in a checkpoint") from exc


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """A stream's position: each shard's, and whose turn it is.

    ``pending``: the shards whose current pass is not over (their positions are in it; the
    others' are at the start of the next pass); ``produced``: batches of the pass delivered.
    """

    shards: tuple[ShardPosition, ...]
    next_shard: int = 0
    pending: tuple[int, ...] = ()
    produced: int = 0

    @classmethod
    def begin(cls, pass_no: int, num_shards: int) -> StreamPosition:
        return cls(tuple(ShardPosition(pass_no) for _ in range(num_shards)), 0,
                   tuple(range(num_shards)), 0)

    def to_data(self) -> dict[str, Any]:
        return {"shards": [s.to_data() for s in self.shards], "next_shard": self.next_shard,
                "pending": list(self.pending), "produced": self.produced}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> StreamPosition:
        return cls(tuple(ShardPosition.from_data(s) for s in data["shards"]),
                   int(data["next_shard"]), tuple(int(k) for k in data["pending"]),
                   int(data["produced"]))
