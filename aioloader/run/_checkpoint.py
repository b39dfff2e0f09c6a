"""The run's checkpoints: its state dict out, a state dict read back into a resume point.

Pure functions of the config and the run's position (the cursor, the resume point, the
cache's size); the run applies what they return under its lock.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence, Sized
from typing import Any

from .._config import LoaderConfig
from .._errors import ResumeError, ResumeWarning
from ..plans._reshape import cache_size
from ..plans._sources import is_stateful
from ..plans._state import Cursor, ResumePoint, choose, make_state, read_state
from ._setup import Setup


def state_of(config: LoaderConfig, seed: int, cursor: Cursor,
             instances: int | None) -> dict[str, Any]:
    """``state_dict()``: where ``cursor`` stands, or why no position can say it."""
    c = config
    if c.lazy and c.loads is not None and not c.loads.ordered and (
            c.batching.options.sampler is not None):
        raise ResumeError(
            "state_dict() with ordered=False and a BatchSampler: loads finish out of "
            "order and the sampler's blocks depend on their instances, so no position "
            "says what was delivered. Use ordered=True to checkpoint (loads still "
            "overlap), or shuffle= without a BatchSampler")
    return make_state(c.fingerprint(), seed, cursor, instances)


def point_of(config: LoaderConfig, setup: Setup,
             state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> ResumePoint:
    """This rank's resume point from one state or every rank's (on this shape or another);
    :class:`ResumeError` for a state of another loader."""
    c = config
    states = [state] if isinstance(state, Mapping) or not isinstance(
        state, Sequence) or not state else list(state)
    points = [read_state(s, c.fingerprint(), seed=c.arguments["seed"], stream=c.lazy)
              for s in states]
    return choose(points, rank=c.topo.rank, world_size=c.topo.world_size,
                  shards=c.shape_shards, refusal=setup.reshape_refusal(),
                  reframe=setup.reframe if c.lazy else None)


def resumed_cursor(point: ResumePoint) -> Cursor:
    """The cursor a loaded state stands at, before the next session starts (a state taken
    then is this one: a stream's position with it, or a stream resumed on a new shape would
    start its pass again)."""
    stream = point.stream
    return Cursor(point.pass_no, point.in_pass, point.in_epoch,
                  stream=(lambda: stream) if stream is not None else None,
                  carried=point.in_epoch, history=point.history)


def warn_skipping(config: LoaderConfig, point: ResumePoint) -> None:
    """A stream whose source has no state of its own resumes by reading and skipping."""
    c = config
    if point.stream is not None and not is_stateful(c.source) and c.loads is None:
        skipped = sum(p.start.raw for p in point.stream.shards)
        if skipped:
            warnings.warn(
                f"resuming {type(c.source).__name__} by reading and skipping {skipped} "
                "instances: it has no state_dict()/load_state_dict() of its own. Give it "
                "those (a position in its files) to resume in constant time",
                ResumeWarning, stacklevel=4)


def held_point(config: LoaderConfig, seed: int, cursor: Cursor,
               instances: int | None) -> ResumePoint:
    """Where the next session starts after a completed epoch stopped its workers, with
    ``batches_per_epoch``: the stream goes on where it stopped."""
    topo = config.topo
    return ResumePoint(
        seed=seed, pass_no=cursor.pass_no, in_pass=cursor.in_pass, in_epoch=0,
        stream=cursor.stream() if cursor.stream is not None else None,
        instances=instances, history=cursor.history, rank=topo.rank,
        world_size=topo.world_size, shards=config.shape_shards)


def cached_count(config: LoaderConfig, cache: Sized | None,
                 resume: ResumePoint | None) -> int | None:
    """A cached reader's instance count for a state: the cache's, or, before the cache is
    read again after ``load_state_dict()``, the resume point's (a new rank's share, on a
    new shape)."""
    if not config.cached:
        return None
    if cache is not None:
        return len(cache)
    topo = config.topo
    return None if resume is None else cache_size(resume.instances, resume.history,
                                                  topo.rank, topo.world_size, config.shards)
