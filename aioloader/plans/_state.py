"""A loader's state dict: where its consumer stands, as JSON data; made, checked and read.

A handful of counters and a stream's shard positions, never data, a reader or a pickle
(issue 10; docs/architecture.md, "Resume: positions, not buffers").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._errors import ResumeError
from ._position import StreamPosition
from ._reshape import History, Progress

FORMAT = "aioloader.DataLoader"
VERSION = 2
READS = (1, 2)  # version 1: the same, without a history
SHAPE = ("rank", "world_size", "shards")  # may differ on resume: see ``choose``


@dataclass
class Cursor:
    """Where the consumer stands; updated as each batch is handed over.

    ``stream``: the live stream producer's position (None for index batches).
    ``carried``: the batches of a resumed epoch delivered before the state was taken, for
    the first epoch after ``load_state_dict`` to count from.
    """

    pass_no: int = 0
    in_pass: int = 0
    in_epoch: int = 0
    stream: Callable[[], StreamPosition] | None = None
    carried: int | None = None
    history: History = ()  # the pass was resumed on other shapes (``_reshape``)

    def begin_epoch(self) -> int:
        """An epoch starts: the batches it has already delivered (a resumed one's)."""
        self.in_epoch, self.carried = self.carried or 0, None
        return self.in_epoch

    def delivered(self) -> None:
        self.in_pass += 1
        self.in_epoch += 1

    def pass_done(self) -> None:
        self.pass_no += 1
        self.in_pass = 0
        self.history = ()


@dataclass(frozen=True)
class ResumePoint:
    """A checked state: where a fresh session starts."""

    seed: int
    pass_no: int
    in_pass: int
    in_epoch: int
    stream: StreamPosition | None
    instances: int | None  # a cached reader's instance count when the state was taken
    history: History = ()
    rank: int = 0  # the shape it was taken on
    world_size: int = 1
    shards: int | None = None


def make_state(fingerprint: Mapping[str, Any], seed: int, cursor: Cursor,
               instances: int | None) -> dict[str, Any]:
    """The JSON-able state dict for ``cursor``."""
    stream = cursor.stream() if cursor.stream is not None else None
    return {
        "format": FORMAT,
        "version": VERSION,
        "loader": dict(fingerprint),
        "seed": seed,
        "pass": cursor.pass_no,
        "batches_in_pass": cursor.in_pass,
        "batches_in_epoch": cursor.in_epoch,
        "instances": instances,
        "stream": stream.to_data() if stream is not None else None,
        "history": [progress.to_data() for progress in cursor.history],
    }


def read_state(state: Any, fingerprint: Mapping[str, Any], *, seed: int | None,
               stream: bool) -> ResumePoint:
    """Check ``state`` against this loader's ``fingerprint`` (and ``seed``, when the user
    chose one) and read it; ResumeError names what is wrong. ``stream``: this loader reads
    a lazy stream (its position is checked against the shards it was taken in)."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise ResumeError(
            f"not an aioloader DataLoader state dict: expected a dict from "
            f"DataLoader.state_dict() (with format {FORMAT!r}), got {_brief(state)}")
    if state.get("version") not in READS:
        raise ResumeError(f"state dict version {state.get('version')!r} is not supported by "
                          f"this aioloader (it reads versions {', '.join(map(str, READS))})")
    try:
        taken = state["loader"]
        differs = [f"{key}={taken.get(key)!r} when the state was taken, {value!r} here"
                   for key, value in fingerprint.items()
                   if key not in SHAPE and taken.get(key, value) != value]
        if seed is not None and state["seed"] != seed:
            differs.append(f"seed={state['seed']!r} when the state was taken, {seed!r} here")
        if differs:
            raise ResumeError(
                "this state was taken from a loader built with other arguments: "
                + "; ".join(differs) + ". Build the loader with the same arguments to resume "
                "(seed=None adopts the state's seed)")
        point = ResumePoint(
            seed=_int(state["seed"], "seed"),
            pass_no=_count(state["pass"], "pass"),
            in_pass=_count(state["batches_in_pass"], "batches_in_pass"),
            in_epoch=_count(state["batches_in_epoch"], "batches_in_epoch"),
            stream=(StreamPosition.from_data(state["stream"])
                    if state["stream"] is not None else None),
            instances=(None if state["instances"] is None
                       else _count(state["instances"], "instances")),
            history=tuple(Progress.from_data(p) for p in state.get("history", ())),
            rank=_count(taken["rank"], "rank"),
            world_size=_count(taken["world_size"], "world_size"),
            shards=None if taken["shards"] is None else _count(taken["shards"], "shards"))
    except ResumeError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ResumeError(f"corrupt aioloader state dict: {type(exc).__name__}: {exc} "
                          "(was it edited, or cut short?)") from exc
    if not 0 <= point.rank < point.world_size:
        raise ResumeError(f"corrupt aioloader state dict: rank {point.rank} of world_size "
                          f"{point.world_size}")
    _check_stream(point, stream)
    return point


def choose(points: Sequence[ResumePoint], *, rank: int, world_size: int,
           shards: int | None, refusal: str | None,
           reframe: Callable[[list[ResumePoint]], StreamPosition] | None = None
           ) -> ResumePoint:
    """Where rank ``rank`` of ``world_size`` (in ``shards`` shards) resumes, from the states
    of one run (one, or every rank's): its own state where the shape is the same; else the
    pass's progress on every rank, put together: index batches as a history
    (``_reshape``), a stream's shards by ``reframe`` (every rank's states, by rank).
    ``refusal``: why this loader cannot resume on another shape (None: it can)."""
    first = points[0]
    for point in points[1:]:
        if (point.seed, point.pass_no, point.history, point.world_size) != (
                first.seed, first.pass_no, first.history, first.world_size):
            raise ResumeError(
                "these states are not of one run at one step: they differ in seed, epoch or "
                f"world size (seed {first.seed} and {point.seed}, pass {first.pass_no} and "
                f"{point.pass_no}, world_size {first.world_size} and {point.world_size}). "
                "Pass the states every rank took at the same step")
    ranks = sorted(p.rank for p in points)
    if len(set(ranks)) != len(ranks):
        raise ResumeError(f"two of these states are of the same rank (ranks {ranks}): pass "
                          "one state per rank")
    if first.world_size == world_size and first.shards == shards:
        own = [p for p in points if p.rank == rank]
        if own:
            return own[0]
    reshaped = (f"a state taken on rank {first.rank} of {first.world_size}"
                + (f" with {first.shards} shard(s)" if first.shards is not None else "")
                + f", resumed on rank {rank} of {world_size}"
                + (f" with {shards} shard(s)" if shards is not None else ""))
    if refusal is not None:
        raise ResumeError(f"{reshaped}: {refusal}")
    missing = sorted(set(range(first.world_size)) - set(ranks))
    if missing:
        raise ResumeError(
            f"{reshaped}: the epoch is dealt again over the ranks, which needs every rank's "
            f"state, and rank(s) {missing} of {first.world_size} are missing. Pass them all: "
            "`loader.load_state_dict([state_of_rank_0, state_of_rank_1, ...])`")
    by_rank = sorted(points, key=lambda p: p.rank)
    if reframe is not None:
        return replace(first, in_pass=max(p.in_pass for p in points),
                       in_epoch=max(p.in_epoch for p in points), stream=reframe(by_rank),
                       instances=None, rank=rank, world_size=world_size, shards=shards)
    history = first.history
    if any(p.in_pass for p in by_rank):  # else the pass had delivered nothing yet
        cached = [p.instances for p in by_rank]
        history = (*history, Progress(
            first.world_size, tuple(p.in_pass for p in by_rank),
            None if None in cached else tuple(n or 0 for n in cached), first.shards or 1))
    return replace(first, in_pass=0, in_epoch=max(p.in_epoch for p in points), stream=None,
                   instances=None, history=history, rank=rank, world_size=world_size,
                   shards=shards)


def _check_stream(point: ResumePoint, lazy: bool) -> None:
    """A lazy loader's stream position against the shards it was taken in (which may not
    be this loader's: see ``choose``)."""
    stream, shards = point.stream, point.shards
    if not lazy:
        if stream is not None:
            raise ResumeError("corrupt aioloader state dict: it holds a stream position, but "
                              "this loader reads index batches")
        return
    if stream is None:  # taken before the stream started: at the start of its pass
        return
    if shards is None:
        raise ResumeError("corrupt aioloader state dict: it holds a stream position, but "
                          "not the number of shards it was taken in")
    if len(stream.shards) != shards:
        raise ResumeError("corrupt aioloader state dict: its stream position does not have "
                          f"{shards} shard(s)")
    if not 0 <= stream.next_shard <= shards or any(
            not 0 <= k < shards for k in stream.pending):
        raise ResumeError("corrupt aioloader state dict: its stream position names shards "
                          f"outside 0..{shards - 1}")
    for pos in stream.shards:
        for name, value in (("pass", pos.pass_no), ("block", pos.start.block),
                            ("raw", pos.start.raw), ("batches", pos.batches)):
            _count(value, f"a shard's {name}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ResumeError(f"corrupt aioloader state dict: {name} is {value!r}, not an int")
    return value


def _count(value: Any, name: str) -> int:
    if _int(value, name) < 0:
        raise ResumeError(f"corrupt aioloader state dict: {name} is {value}, below 0")
    return int(value)


def _brief(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
