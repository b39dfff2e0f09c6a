"""What a pass of a piece reader left when it is resumed on another shape.

The old shape's shards (rank x worker, "lanes") each stood somewhere in their deal of the
pass: the reader's state at the start of the loader's block in progress, plus the instances
of that block the consumer had (the loader replays them: ``done``, counted from the block's
start). Put together, that says which items of which pieces were delivered: a :class:`Cut`
per piece. The new shape deals the pieces not wholly delivered and drops the items that
were, so every item of the pass is seen once, whatever the new numbers of workers and ranks.

Only a few pieces are cut: a lane's delivered items are whole pieces before its current
one, a prefix of that one, and the items of one block past it (for a Parquet row group
known from its footer; for a tar shard, counted by reading the block's bytes again). With
fewer pieces than old lanes, every lane read every piece and kept every S-th item of the
pass, so each piece's size is needed: a tar shard is then read once more to count it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import ResumeError

# (piece, byte offset or row, item in the piece, limit) -> items from there, at most limit
Count = Callable[[int, int, int, int | None], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class Lane:
    """An old shard's place when its state was taken: ``piece`` (into its deal's pieces),
    ``offset`` and ``item`` in it, ``counted`` items of its pass, then ``done``: the items
    past that place delivered (counted from it, in the lane's own stream)."""

    piece: int
    offset: int
    item: int
    counted: int
    done: tuple[int, ...]

    def to_data(self) -> list[Any]:
        return [self.piece, self.offset, self.item, self.counted, list(self.done)]

    @classmethod
    def from_data(cls, data: Any) -> Lane:
        piece, offset, item, counted, done = data
        return cls(int(piece), int(offset), int(item), int(counted),
                   tuple(sorted(int(j) for j in done)))


@dataclass(frozen=True, slots=True)
class Frontier:
    """The old shape: ``lanes[k]`` is old shard k's (None: its pass was over), the pass
    ``pass_no`` (None: no lane had left the pass's first block, so the reading pass's)."""

    lanes: tuple[Lane | None, ...]
    pass_no: int | None

    def to_data(self) -> dict[str, Any]:
        return {"pass": self.pass_no,
                "lanes": [lane.to_data() if lane is not None else None for lane in self.lanes]}

    @classmethod
    def from_data(cls, reader: str, data: Any) -> Frontier:
        try:
            lanes = tuple(Lane.from_data(d) if d is not None else None for d in data["lanes"])
            pass_no = None if data["pass"] is None else int(data["pass"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"corrupt {reader} state: its frontier {data!r:.200} ({exc})") \
                from exc
        if not lanes:
            raise ValueError(f"corrupt {reader} state: a frontier of no shards")
        return cls(lanes, pass_no)


@dataclass(slots=True)
class Cut:
    """The items of one piece the old shape delivered: those before ``prefix``, those in
    ``extra``, or (``rule``) those a function of the item says; ``whole``: all of them.
    ``start``: the (offset, item) where the prefix ends, when known (a reader seeks there
    instead of reading the prefix)."""

    prefix: int = 0
    extra: set[int] = field(default_factory=set)
    rule: Callable[[int], bool] | None = None
    whole: bool = False
    start: tuple[int, int] = (0, 0)

    def has(self, item: int) -> bool:
        return (self.whole or item < self.prefix or item in self.extra
                or (self.rule is not None and self.rule(item)))


def lane_of(state: dict[str, Any] | None, done: Sequence[int], reader: str, k: int,
            shards: int) -> Lane:
    """Old shard ``k`` of ``shards``'s lane, from its reader state at its block's start
    (None: the pass's start); a ResumeError when that state cannot be resumed elsewhere."""
    if state is None:
        return Lane(0, 0, 0, 0, tuple(sorted(done)))
    if state.get("frontier") is not None:
        raise ResumeError(
            f"this {reader} state was taken in a pass that had already been resumed on "
            "another shape; it resumes on the shape it was taken on (the same num_workers "
            "and world size), or on any shape from a state taken in a later pass")
    if (state["shard"], state["shards"]) != (k, shards) or state.get("item") is None:
        raise ResumeError(
            f"{reader} state of shard {state['shard']} of {state['shards']} found where shard "
            f"{k} of {shards} was expected, or without its item in the piece (taken by an "
            "older aioloader): resume on the shape the state was taken on")
    return Lane(state["piece"], state["offset"], state["item"], state["counted"],
                tuple(sorted(done)))


async def cuts(frontier: Frontier, order: Sequence[int], count: Count) -> dict[int, Cut]:
    """The pieces (by index) the old shape delivered items of, and which: the old lanes
    dealt ``order`` (the pass's piece order) as :func:`~._pieces.deal_order` does."""
    lanes = frontier.lanes
    shards = len(lanes)
    out: dict[int, Cut] = {}
    if len(order) >= shards:  # each lane read its own pieces, every item of them
        for k, lane in enumerate(lanes):
            mine = list(order[k::shards])
            if lane is None:
                out.update((q, Cut(whole=True)) for q in mine)
                continue
            out.update((q, Cut(whole=True)) for q in mine[:lane.piece])
            if lane.piece < len(mine):
                out[mine[lane.piece]] = Cut(prefix=lane.item, start=(lane.offset, lane.item))
            await _spread(lane, mine, out, count)
        return out
    # Fewer pieces than lanes: lane k kept items k, k + S, ... of the pass (across pieces).
    sizes = [await count(q, 0, 0, None) for q in order]
    rules: list[tuple[int | None, int, frozenset[int]]] = []
    for k, lane in enumerate(lanes):
        if lane is None:
            rules.append((None, 0, frozenset()))
        else:
            first = lane.counted + (k - lane.counted) % shards  # its next item of the pass
            rules.append((lane.counted, first, frozenset(lane.done)))
    base = 0
    for q, size in zip(order, sizes, strict=True):
        out[q] = Cut(rule=_strided(base, shards, tuple(rules)))
        base += size
    return out


async def _spread(lane: Lane, mine: list[int], out: dict[int, Cut], count: Count) -> None:
    """Mark ``lane.done`` (items past the lane's place) in the pieces they fall in."""
    if not lane.done:
        return
    last = lane.done[-1]
    pos, piece, offset, item = 0, lane.piece, lane.offset, lane.item
    while pos <= last and piece < len(mine):
        q = mine[piece]
        got = await count(q, offset, item, last + 1 - pos)
        cut = out.setdefault(q, Cut())
        cut.extra.update(item + j - pos for j in lane.done if pos <= j < pos + got)
        pos += got
        piece, offset, item = piece + 1, 0, 0


def _strided(base: int, shards: int,
             rules: tuple[tuple[int | None, int, frozenset[int]], ...]) -> Callable[[int], bool]:
    """Whether an item of the piece whose first item is the pass's ``base``-th was
    delivered: lane ``g % shards`` kept item g of the pass; ``rules`` say each lane's
    (items counted at its place or None: its pass was over, its next kept item, ``done``)."""

    def delivered(item: int) -> bool:
        g = base + item
        counted, first, done = rules[g % shards]
        if counted is None or g < counted:
            return True
        return g >= first and (g - first) // shards in done

    return delivered
