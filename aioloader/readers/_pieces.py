"""Pieces of a dataset (tar shards, Parquet row groups) dealt to this process's shard.

A format reader cuts its data into pieces whose items it can reach by seeking: a WebDataset
shard (a byte offset in a tar file) or a Parquet row group (a row in it). Every process of a
pass (rank x worker) sees the same ordered list of pieces and keeps its own, so nothing is
read twice; a position is (the piece, how far into it), so resuming seeks to it. A pass
resumed on another shape deals what the old shape left (``_leftover``).
"""

from __future__ import annotations

import hashlib
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._errors import ResumeError
from ..pipeline._loads import report_skipped
from ..plans._sources import Reader
from ._jsonl import reader_shard
from ._leftover import Count, Cut, Frontier, Lane, cuts, lane_of

OnError = Literal["raise", "skip"]
STATE_VERSION = 2  # 1: without the item in the piece nor a frontier


def this_shard() -> tuple[int, int]:
    """(shard id, number of shards) of this process: rank x num_workers + worker id."""
    return reader_shard()


@dataclass(frozen=True, slots=True)
class Deal:
    """Which pieces of a pass this shard reads, and which of their items it keeps.

    With at least as many pieces as shards, shard s reads pieces s, s + S, ... (of the pass's
    order) and keeps all their items (``step`` 1). With fewer, every shard reads every piece
    and keeps items s, s + S, ... of the pass (counted across pieces): a piece is split
    within, at the cost of reading it in each shard.
    """

    order: tuple[int, ...]  # the pass's piece order (indices into the piece list)
    mine: tuple[int, ...]  # the pieces this shard reads, in order
    shard: int
    shards: int

    @property
    def step(self) -> int:
        return 1 if len(self.order) >= self.shards else self.shards

    @property
    def first(self) -> int:
        """The first item (of the pass, across pieces) this shard keeps when split."""
        return 0 if self.step == 1 else self.shard


def pass_order(num_pieces: int, *, shuffle: bool, seed: int, pass_no: int) -> list[int]:
    """The pieces' order in pass ``pass_no``: the same in every process (it depends on
    ``seed`` and the pass only)."""
    order = list(range(num_pieces))
    if shuffle:
        random.Random(f"{seed}:{pass_no}").shuffle(order)
    return order


def deal_order(order: Sequence[int], shard: int, shards: int) -> Deal:
    """Shard ``shard`` of ``shards``'s deal of the pieces ``order``."""
    mine = order[shard::shards] if len(order) >= shards else order
    return Deal(tuple(order), tuple(mine), shard, shards)


def digest(names: list[str]) -> str:
    """A short fingerprint of the piece list, so a state is not resumed over other data."""
    return hashlib.blake2b(b"\0".join(map(os.fsencode, names)), digest_size=12).hexdigest()


class Position:
    """A format reader's place in its pass: the piece (index into the deal's ``mine``), how
    far into it (a byte offset or a row, and the item there), and how many items of the
    pass were counted (for a split deal; in a pass resumed on another shape, those the old
    shape left). ``cuts``: what the old shape delivered of each piece (``_leftover``).
    ``state()`` is what ``state_dict()`` returns."""

    def __init__(self, reader: str, names: list[str], deal: Deal, pass_no: int,
                 frontier: Frontier | None = None, cuts: dict[int, Cut] | None = None) -> None:
        self.reader = reader
        self.names = names
        self.deal = deal
        self.pass_no = pass_no
        self.frontier = frontier
        self.cuts = cuts or {}
        self.piece = 0
        self.offset = 0
        self.item = 0
        self.counted = 0
        self._digest = digest(names)

    def state(self) -> dict[str, Any]:
        return {"reader": self.reader, "version": STATE_VERSION, "pass": self.pass_no,
                "shard": self.deal.shard, "shards": self.deal.shards,
                "num_pieces": len(self.names), "digest": self._digest,
                "piece": self.piece, "offset": self.offset, "item": self.item,
                "counted": self.counted,
                "frontier": self.frontier.to_data() if self.frontier is not None else None}

    def cut(self, piece: int) -> Cut | None:
        """What the old shape delivered of piece ``piece`` (into ``names``); None: nothing."""
        return self.cuts.get(piece)

    def next_piece(self) -> None:
        """On to the next piece of the deal, at its start (or where its delivered prefix
        ends)."""
        self.piece += 1
        self.offset, self.item = self.start_of(self.piece)

    def start_of(self, piece: int) -> tuple[int, int]:
        """(offset, item) where piece ``piece`` (into the deal's ``mine``) begins to be read."""
        cut = self.cut(self.deal.mine[piece]) if piece < len(self.deal.mine) else None
        return cut.start if cut is not None else (0, 0)


def start_state(reader: str) -> dict[str, Any]:
    shard, shards = this_shard()
    return {"reader": reader, "version": STATE_VERSION, "pass": 0, "shard": shard,
            "shards": shards, "num_pieces": None, "digest": None, "piece": 0, "offset": 0,
            "item": 0, "counted": 0, "frontier": None}


def checked_state(reader: str, state: Any) -> dict[str, Any]:
    """A copy of ``state`` when it is one of ``reader``'s states, else a ValueError saying
    what to pass."""
    if not isinstance(state, dict) or state.get("reader") != reader:
        raise ValueError(f"not a {reader} state: {state!r:.200}; pass what "
                         f"{reader}.state_dict() returned")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{reader} state version {state.get('version')!r} is not supported: "
                         f"this aioloader reads version {STATE_VERSION}")
    out: dict[str, Any] = {"frontier": None, **state}
    anywhere = out["frontier"] is not None and out.get("shards") is None  # see reshape_state
    for key in ("pass", "shard", "shards", "piece", "offset", "counted", "item"):
        value = out.get(key)
        if value is None and anywhere and key in ("pass", "shard", "shards"):
            continue
        if type(value) is not int or value < 0:
            raise ValueError(f"corrupt {reader} state: {key!r} is {value!r}, not an int >= 0")
    if out["frontier"] is not None:
        Frontier.from_data(reader, out["frontier"])  # checked here, read at the pass
    return out


def check_data(reader: str, state: dict[str, Any], names: list[str]) -> None:
    """A ValueError when ``state`` was taken over other pieces than ``names``."""
    if state["num_pieces"] is None:  # taken before any pass
        return
    if state["num_pieces"] != len(names) or state["digest"] != digest(names):
        raise ValueError(f"{reader} state was taken over {state['num_pieces']} other pieces "
                         f"than this read's {len(names)}: the data changed")


def check_fits(state: dict[str, Any], position: Position) -> None:
    """A ValueError naming what differs when ``state`` was taken for another shard than
    ``position``'s pass."""
    reader, deal = position.reader, position.deal
    if state["num_pieces"] is None or state["shards"] is None:  # any shard may start there
        return
    if (state["shard"], state["shards"]) != (deal.shard, deal.shards):
        raise ValueError(f"{reader} state was taken for shard {state['shard']} of "
                         f"{state['shards']}, this read is shard {deal.shard} of "
                         f"{deal.shards}: resume with the num_workers and world size it was "
                         "taken with")
    if state["piece"] > len(deal.mine):
        raise ValueError(f"corrupt {reader} state: piece {state['piece']} of "
                         f"{len(deal.mine)}")


class Skips:
    """What ``on_error="skip"`` left out in this process's latest pass: counted, the first
    one warned about, each one listed (``(piece, member, error)``)."""

    def __init__(self, reader: str) -> None:
        self.reader = reader
        self.skipped: list[tuple[str, str, str]] = []

    def add(self, piece: str, member: str, exc: BaseException) -> None:
        self.skipped.append((piece, member, repr(exc)))
        if len(self.skipped) == 1:
            warnings.warn(f"{self.reader}: skipping {member} of {piece} ({exc}); further "
                          f"errors are skipped without a warning and counted in "
                          f"{self.reader}.num_skipped (and in the loader's stats().skipped)",
                          UserWarning, stacklevel=3)


class PieceReader(Reader):
    """What the format readers share: they shard themselves by pieces, keep a
    :class:`Position` per pass (``state_dict``/``load_state_dict``), and skip bad pieces or
    samples when asked (``num_skipped``, ``skipped``: this process's latest pass)."""

    manual_multiprocess_sharding = True
    manual_distributed_sharding = True
    reader_name = "PieceReader"

    def _setup(self, *, on_error: str, seed: int) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.seed = seed
        self.num_skipped = 0
        self.skipped: list[tuple[str, str, str]] = []
        self._passes = 0
        self._position: Position | None = None
        self._loaded: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_position": None}  # a worker's copy has read nothing

    def state_dict(self) -> dict[str, Any]:
        """Where the latest pass stands: just after the last instance it yielded (JSON data).

        Before any pass, the start; after :meth:`load_state_dict`, the state loaded."""
        if self._loaded is not None:
            return dict(self._loaded)
        if self._position is not None:
            return self._position.state()
        return start_state(self.reader_name)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``read`` start where ``state`` was taken (a ValueError when it is
        not such a state; one taken over other data, or for another shard of readers, is a
        ValueError from that pass)."""
        self._loaded = checked_state(self.reader_name, state)
        if self._loaded["pass"] is not None:
            self._passes = self._loaded["pass"]

    def reshape_state(self, lanes: Sequence[tuple[dict[str, Any] | None, Sequence[int]]
                                            | None]) -> dict[str, Any]:
        """The state a pass starts from on a new shape (any numbers of workers and ranks),
        given where each shard of the old shape stood: ``lanes[k]`` is shard k's (rank x
        num_workers + worker) ``(state, done)``, its ``state_dict()`` at the start of the
        loader's block in progress (None: the pass's start) and the items of that block
        delivered (counted from its start); None for a shard whose pass was over. The
        loader calls it; it reads nothing (the pieces' items are counted by the pass)."""
        shards = len(lanes)
        states: list[dict[str, Any]] = []
        places: list[Lane | None] = []
        for k, lane in enumerate(lanes):
            state = None
            if lane is not None and lane[0] is not None:
                state = checked_state(self.reader_name, lane[0])
                states.append(state)
            places.append(None if lane is None else lane_of(state, lane[1], self.reader_name,
                                                            k, shards))
        passes = {state["pass"] for state in states}
        digests = {(state["num_pieces"], state["digest"]) for state in states}
        if len(passes) > 1 or len(digests) > 1:
            raise ResumeError(f"the {self.reader_name} states of these shards are of other "
                              f"passes or data (passes {sorted(passes)}): pass the states "
                              "every rank took at the same step")
        frontier = Frontier(tuple(places), passes.pop() if passes else None)
        num_pieces, known = digests.pop() if digests else (None, None)
        return {"reader": self.reader_name, "version": STATE_VERSION,
                "pass": frontier.pass_no, "shard": None, "shards": None,
                "num_pieces": num_pieces, "digest": known, "piece": 0, "offset": 0, "item": 0,
                "counted": 0, "frontier": frontier.to_data()}

    def _next_pass(self) -> tuple[dict[str, Any] | None, int]:
        """(the state to resume from, the pass number): called when ``read`` is."""
        loaded, self._loaded = self._loaded, None
        pass_no = self._passes
        self._passes += 1
        return loaded, pass_no

    async def _begin(self, names: list[str], loaded: dict[str, Any] | None, pass_no: int, *,
                     shuffle: bool, count: Count) -> Position:
        """This pass's position over the pieces ``names``: dealt, and resumed from
        ``loaded``; a pass resumed on a new shape deals what the old one left, counting
        items of some pieces with ``count`` (``_leftover``)."""
        frontier = None
        cut_of: dict[int, Cut] = {}
        order = pass_order(len(names), shuffle=shuffle, seed=self.seed, pass_no=pass_no)
        if loaded is not None:
            check_data(self.reader_name, loaded, names)
            if loaded["frontier"] is not None:
                frontier = Frontier.from_data(self.reader_name, loaded["frontier"])
                cut_of = await cuts(frontier, order, count)
                order = [q for q in order if q not in cut_of or not cut_of[q].whole]
        dealt = deal_order(order, *this_shard())
        at = self._position = Position(self.reader_name, names, dealt, pass_no, frontier,
                                       cut_of)
        at.offset, at.item = at.start_of(0)
        if loaded is not None and loaded["shards"] is not None:
            check_fits(loaded, at)
            at.piece, at.offset, at.item, at.counted = (
                loaded["piece"], loaded["offset"], loaded["item"], loaded["counted"])
        return at

    async def _skip(self, skips: Skips, piece: str, member: str, exc: BaseException) -> None:
        """Raise ``exc`` (``on_error="raise"``), or count and list it, and report it to the
        loader reading this (``loader.stats().skipped``, ``loader.skipped``)."""
        if self.on_error == "raise":
            raise exc
        skips.add(piece, member, exc)
        self.num_skipped = len(skips.skipped)
        await report_skipped(f"{piece}: {member}", exc)

    def _skips(self) -> Skips:
        """A new pass's record of what it skips."""
        skips = Skips(self.reader_name)
        self.num_skipped, self.skipped = 0, skips.skipped
        return skips
