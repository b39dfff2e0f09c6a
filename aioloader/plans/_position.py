"""Where a pass over a streaming source stands: block starts and shard positions, as data.

A block's batches depend only on its instances and its number (``_batcher.Batcher``), so a
shard's position is a block start plus the batches of the block delivered (issue 10); a
pass resumed on another shape carries a :class:`Frontier` (issue 21). See
docs/architecture.md, "Resume: positions, not buffers".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .._errors import ResumeError
from ._samplers import derive_seed, index_batches


@dataclass(frozen=True, slots=True)
class BlockStart:
    """Block ``block`` of a pass begins after ``raw`` instances of the source's stream (the
    whole stream, before the loader's sharding); ``state`` is the source's ``state_dict()``
    there (None: the pass's start, or a source without one)."""

    block: int
    raw: int
    state: Any = None

    def to_wire(self) -> list[Any]:  # (read back as BlockStart(*data))
        return [self.block, self.raw, self.state]


PASS_START = BlockStart(0, 0, None)


@dataclass(frozen=True, slots=True)
class ShardPosition:
    """A shard stands in pass ``pass_no``, ``batches`` batches into the block at ``start``.

    ``size``: that block's instances, when it was planned whole (None: streamed, or not
    known yet). ``frontier``: what earlier shapes of the pass delivered (the same for its
    every shard). ``keys`` (``ordered=False``, where blocks say nothing): the keys
    delivered, counted from ``start`` in this shard's stream, as ``(low, *done)``: every key
    before ``low`` and those ``done`` after it. ``gap``: a key of the block was skipped on
    error, so its batches are no replay of its first instances (a new shape refuses it).
    """

    pass_no: int
    start: BlockStart = PASS_START
    batches: int = 0
    size: int | None = None
    frontier: Frontier | None = None
    keys: tuple[int, ...] | None = None
    gap: bool = False

    def to_data(self) -> list[Any]:
        return [self.pass_no, *self.start.to_wire(), self.batches, self.size,
                self.frontier.to_data() if self.frontier is not None else None,
                list(self.keys) if self.keys is not None else None, self.gap]

    @classmethod
    def from_data(cls, data: list[Any]) -> ShardPosition:
        pass_no, block, raw, state, batches, *rest = data  # 5 fields: a version 1 state
        size, frontier, keys, gap = rest if rest else (None, None, None, False)
        return cls(pass_no, BlockStart(block, raw, state), batches, size,
                   Frontier.from_data(frontier) if frontier is not None else None,
                   tuple(int(k) for k in keys) if keys is not None else None, bool(gap))


# [block, index, start or None, the block's size or None(, keys, gap)]: where a batch lies,
# sent with it; keys: the numbers in the shard's stream of the keys it holds, when loads
# finish out of order; gap: True when a key of its block was skipped on error before it
Mark = list[Any]


class ShardTracker:
    """The consumer's side of one shard: its position after the batches handed over."""

    def __init__(self, position: ShardPosition) -> None:
        self.position = position
        keys = position.keys or (0,)
        self._low = keys[0]  # ordered=False: every key before it was delivered
        self._done = set(keys[1:])  # and these after it

    def delivered(self, mark: Mark) -> None:
        block, index, start, size, *more = mark
        keys, gap = [*more, None, False][:2]
        at = self.position
        if keys is not None:
            self._done.update(keys)
            while self._low in self._done:
                self._done.discard(self._low)
                self._low += 1
            self.position = replace(at, keys=(self._low, *sorted(self._done)))
            return
        begin = BlockStart(*start) if start is not None else at.start
        if begin.block != block:
            raise AssertionError(f"batch {index} of block {block} arrived without the "
                                 f"block's start (position {self.position})")
        self.position = ShardPosition(at.pass_no, begin, index + 1, size, at.frontier,
                                      gap=bool(gap))

    def ended(self) -> None:
        tagged = self.position.keys is not None
        self.position = ShardPosition(self.position.pass_no + 1, keys=(0,) if tagged else None)
        self._low, self._done = 0, set()


class Batching(Protocol):
    """What replaying a block needs of the loader's batching options (``BatchOptions``)."""

    @property
    def batch_size(self) -> int | None: ...
    @property
    def shuffle(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Level:
    """One earlier shape of a pass, when its states were taken: shard k of ``count`` (the
    loader's sharding: raw positions k, k + count, ...) stood at ``positions[k]`` (None: its
    pass was over), its blocks seeded from ``seeds[k]``."""

    count: int
    positions: tuple[ShardPosition | None, ...]
    seeds: tuple[int, ...]

    def to_data(self) -> list[Any]:
        return [self.count, [p.to_data() if p is not None else None for p in self.positions],
                list(self.seeds)]

    @classmethod
    def from_data(cls, data: list[Any]) -> Level:
        count, positions, seeds = data
        level = cls(int(count), tuple(ShardPosition.from_data(p) if p is not None else None
                                      for p in positions), tuple(int(x) for x in seeds))
        if level.count < 1 or len(level.positions) != level.count or len(
                level.seeds) != level.count:
            raise ValueError(f"a frontier level of {level.count} shard(s) holds "
                             f"{len(level.positions)} position(s)")
        return level


@dataclass(frozen=True, slots=True)
class Frontier:
    """What a pass delivered under earlier shapes (another num_workers or world size), which
    a stream resumed on a new shape skips: per shard, everything before its block start and
    the block's first batches, replayed from its seed and size (nothing per instance)."""

    levels: tuple[Level, ...]

    def to_data(self) -> list[Any]:
        return [level.to_data() for level in self.levels]

    @classmethod
    def from_data(cls, data: list[Any]) -> Frontier:
        return cls(tuple(Level.from_data(level) for level in data))

    def extended(self, level: Level, options: Batching) -> Frontier:
        """This frontier with ``level`` (the shape that just stopped) on top.

        With ``ordered=False`` a shard's keys were numbered in its stream past this
        frontier; they are renumbered in the shard's raw stride, as a first shape numbers
        them, so that no level depends on the ones under it and levels stack."""
        if not self.levels or all(p is None or p.keys is None for p in level.positions):
            return Frontier((*self.levels, level))
        earlier = self.delivered(options)
        positions = tuple(
            p if p is None or p.keys is None
            else replace(p, keys=_in_stride(level.count, _first(level, k, p), p.keys, earlier))
            for k, p in enumerate(level.positions))
        return Frontier((*self.levels, replace(level, positions=positions)))

    def restart(self) -> BlockStart | None:
        """Where the new shards begin reading: the earliest block start of the last shape's
        shards (with the source's own state there); None: every shard's pass was over."""
        level = self.levels[-1]
        starts = [(_low(level, k, p), p.start.state) for k, p in enumerate(level.positions)
                  if p is not None]
        if not starts:
            return None
        raw, state = min(starts, key=lambda start: start[0])
        return BlockStart(0, raw, state)

    def delivered(self, options: Batching) -> Callable[[int], bool]:
        """Whether the instance at a raw position was delivered under an earlier shape."""
        tests: list[tuple[int, list[int | None], set[int]]] = []

        def earlier(raw: int) -> bool:
            for count, lows, done in tests:
                low = lows[raw % count]
                if low is None or raw < low or raw in done:
                    return True
            return False

        for level in self.levels:
            lows = [_low(level, k, p) if p is not None else None
                    for k, p in enumerate(level.positions)]
            done: set[int] = set()
            for k, p in enumerate(level.positions):
                if p is not None and p.keys is not None:  # (numbered in the raw stride:
                    first = _first(level, k, p)  # see ``extended``)
                    done.update(first + n * level.count for n in p.keys[1:])
                elif p is not None and p.batches:
                    done.update(_replayed(options, level, k, p, earlier if tests else None))
            tests.append((level.count, lows, done))
        return earlier


def _in_stride(count: int, first: int, keys: tuple[int, ...],
               earlier: Callable[[int], bool]) -> tuple[int, ...]:
    """``keys`` (a low mark, then numbers past it) of a stream that left out the raw
    positions ``earlier`` delivered, as numbers in the raw stride ``first, first + count,
    ...``: the n-th key the stream kept lies at the stride's ``m``-th position."""
    wanted = sorted(set(keys))
    found: dict[int, int] = {}
    raw, n = first, 0
    while len(found) < len(wanted):
        if not earlier(raw):
            if n in keys:
                found[n] = (raw - first) // count
            n += 1
        raw += count
    return tuple(found[n] for n in keys)


def _first(level: Level, k: int, p: ShardPosition) -> int:
    """The raw position of shard ``k``'s first instance from its start."""
    return p.start.raw + (k - p.start.raw) % level.count


def _low(level: Level, k: int, p: ShardPosition) -> int:
    """Shard ``k`` delivered all its instances before this raw position."""
    if p.keys is None:
        return p.start.raw
    return _first(level, k, p) + p.keys[0] * level.count


def delivered_in_block(options: Batching, position: ShardPosition, seed: int) -> list[int]:
    """The instances the first ``position.batches`` batches of its block held, counted from
    the block's start in the shard's own stream (``seed``: the shard's pass seed). For a
    source that splits itself: it says where that stream stood (``reshape_state``)."""
    level = Level(1, (position,), (seed,))
    return sorted(raw - position.start.raw for raw in _replayed(options, level, 0, position,
                                                                 None))


def _replayed(options: Batching, level: Level, k: int, p: ShardPosition,
              earlier: Callable[[int], bool] | None) -> list[int]:
    """The raw positions in the first ``p.batches`` batches of shard ``k``'s block."""
    if p.gap:
        raise ResumeError(
            "a key was skipped on error (on_error='skip') in the block a stream's state was "
            "taken in, so the batches it delivered cannot be told on a new shape: resume it "
            "on the num_workers and world size it was taken with, or from a later state")
    count, first = level.count, _first(level, k, p)
    assert options.batch_size is not None, "a BatchSampler's blocks are not replayed"
    shuffled = options.shuffle
    if shuffled and p.size is None:
        raise ResumeError("this state was taken by an older aioloader, whose positions do "
                          "not say a shuffled block's size: resume it on the shape it was "
                          "taken on")
    need = p.size if shuffled and p.size is not None else p.batches * options.batch_size
    raws: list[int] = []
    if earlier is None:
        raws = list(range(first, first + need * count, count))
    else:  # the block's instances are those the earlier shapes left (finitely many tried)
        raw = first
        for _ in range((need + 1) * count * 64):
            if len(raws) == need:
                break
            if not earlier(raw):
                raws.append(raw)
            raw += count
    if not shuffled:
        return raws[: p.batches * options.batch_size]
    # (drop_last, which a last short block had, cuts no batch before the ones delivered)
    plan = index_batches(len(raws), options.batch_size, drop_last=False, shuffle=True,
                         rng=random.Random(derive_seed(level.seeds[k], p.start.block)))
    return [raws[i] for batch in plan[: p.batches] for i in batch]


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
