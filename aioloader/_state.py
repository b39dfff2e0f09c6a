"""A loader's state dict: where its consumer stands, as JSON data; made, checked and read.

The order of an epoch is a pure function of (seed, epoch, rank, world size) and, for
streams, of each shard's position (``_position``). So the state is a handful of counters:
the pass the next batch comes from, how many of its batches were handed over, and for a
stream each shard's block start. It never holds data, a reader or a pickle (issue 10).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import ResumeError
from ._position import StreamPosition

FORMAT = "aioloader.DataLoader"
VERSION = 1


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


@dataclass(frozen=True)
class ResumePoint:
    """A checked state: where a fresh session starts."""

    seed: int
    pass_no: int
    in_pass: int
    in_epoch: int
    stream: StreamPosition | None
    instances: int | None  # a cached reader's instance count when the state was taken


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
    }


def read_state(state: Any, fingerprint: Mapping[str, Any], *, seed: int | None,
               shards: int | None) -> ResumePoint:
    """Check ``state`` against this loader's ``fingerprint`` (and ``seed``, when the user
    chose one) and read it; ResumeError names what is wrong. ``shards``: how many shards
    this loader's stream has (None: it is not a stream)."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise ResumeError(
            f"not an aioloader DataLoader state dict: expected a dict from "
            f"DataLoader.state_dict() (with format {FORMAT!r}), got {_brief(state)}")
    if state.get("version") != VERSION:
        raise ResumeError(f"state dict version {state.get('version')!r} is not supported by "
                          f"this aioloader (it reads version {VERSION})")
    try:
        taken = state["loader"]
        differs = [f"{key}={taken.get(key)!r} when the state was taken, {value!r} here"
                   for key, value in fingerprint.items() if taken.get(key, value) != value]
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
                       else _count(state["instances"], "instances")))
    except ResumeError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ResumeError(f"corrupt aioloader state dict: {type(exc).__name__}: {exc} "
                          "(was it edited, or cut short?)") from exc
    _check_stream(point, shards)
    return point


def _check_stream(point: ResumePoint, shards: int | None) -> None:
    stream = point.stream
    if shards is None:
        if stream is not None:
            raise ResumeError("corrupt aioloader state dict: it holds a stream position, but "
                              "this loader reads index batches")
        return
    if stream is None:  # taken before the stream started: at the start of its pass
        return
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
