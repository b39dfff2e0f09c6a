"""Setup: a loader's options as data, and the one place producers and workers are made."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._loads import LoadOptions, SkipLog
from ._local import LocalIndex, LocalInstances, LocalStream
from ._pipeline import BatchOptions
from ._position import ShardPosition, StreamPosition
from ._producers import Plan, WorkerIndex, WorkerInstances, WorkerStream
from ._session import Producer
from ._sources import Kind
from ._standby import StandbyPool
from ._supervisor import RestartBudget, Supervisor
from ._worker import Plan as Role
from ._worker import WorkerSpec


@dataclass(frozen=True)
class Setup:
    """A loader's options as data: how its producers (and their workers) are made.

    The loader asks for a producer by what it wants (a stream, index batches, one pass of
    instances); only here are worker specs built and supervisors made.
    """

    source: Any
    kind: Kind
    data_path: Any
    options: BatchOptions
    collate_fn: Callable[[list[Any]], Any] | None
    num_workers: int
    start_method: str
    prefetch: int
    zero_copy: bool
    seed: int
    rank: int
    world_size: int
    timed: bool  # a timeout is set: progress is reported, nothing runs inline
    budget: RestartBudget = field(default_factory=RestartBudget)  # max_worker_restarts
    max_batches: int | None = None  # max_batches_per_worker
    max_rss: int | None = None  # max_worker_rss
    loads: LoadOptions | None = None  # the load stage (issue 11): the source yields keys
    skips: SkipLog = field(default_factory=SkipLog)  # keys skipped on error, per loader
    worker_init_fn: Callable[[int], object] | None = None  # torch's, once per worker process
    worker_type: str = "process"  # or "thread": workers in this process, batches by reference
    worker_nice: int = 0  # added to each worker process's niceness (os.nice)
    standby: StandbyPool | None = None  # spawn: warm processes for the first workers (issue 13)

    def _supervisor(self, role: Role, source: Any, kind: Kind, first_pass: int,
                    starts: tuple[ShardPosition, ...] | None = None) -> Supervisor:
        spec = WorkerSpec(
            source=source, kind=kind, data_path=self.data_path, plan=role,
            options=self.options, collate_fn=self.collate_fn, worker_id=0,
            num_workers=self.num_workers, rank=self.rank, world_size=self.world_size,
            seed=self.seed, first_pass=first_pass, slots=self.prefetch,
            parent_pid=os.getpid() if self.start_method != "forkserver" else 0,
            progress=self.timed, starts=starts,
            # A cache-filling pass is read once: recycling is for the epochs' workers.
            max_batches=self.max_batches if role != "instances" else None,
            max_rss=self.max_rss if role != "instances" else None,
            loads=self._loads_of(source), worker_init_fn=self.worker_init_fn,
            threaded=self.worker_type == "thread", nice=self.worker_nice)
        return Supervisor(spec, self.num_workers, self.start_method, lease=self.zero_copy,
                          budget=self.budget, skips=self.skips, standby=self.standby)

    @property
    def shards(self) -> int:
        """How many shards a stream is read in (one per worker; one in this process)."""
        return max(self.num_workers, 1)

    def stream(self, start: StreamPosition, seed_for: Callable[[int], int]) -> Producer:
        """Batches of passes over a streaming source, each worker over its shard, from
        ``start`` on (``StreamPosition.begin(pass, shards)``: a pass's start)."""
        if self.num_workers == 0:
            return LocalStream(self.source, self.kind, self.data_path, self.options,
                               self.collate_fn, seed_for, start.shards[0], self.rank,
                               self.world_size, timed=self.timed, produced=start.produced,
                               loads=self.loads, skips=self.skips)
        first_pass = min(p.pass_no for p in start.shards)
        sup = self._supervisor("stream", self.source, self.kind, first_pass, start.shards)
        return WorkerStream(sup, start)

    def index(self, data: Sequence[Any], plan: Plan, first_pass: int, *,
              plan_ahead: bool, skip: int = 0) -> Producer:
        """Index batches of ``data`` (a dataset, or cached instances), planned by ``plan``;
        ``skip``: batches of the first pass already delivered (a resume)."""
        if self.num_workers == 0:
            return LocalIndex(data, plan, first_pass, self.collate_fn, timed=self.timed,
                              skip=skip, loads=self._loads_of(data), skips=self.skips,
                              ahead=self.prefetch)
        return WorkerIndex(self._supervisor("index", data, Kind.MAP, first_pass), plan,
                           first_pass, self.prefetch, plan_ahead=plan_ahead, skip=skip)

    def instances(self, pass_no: int) -> Producer:
        """One pass of a streaming source's instances, in chunks (to fill a cache)."""
        if self.num_workers == 0:
            return LocalInstances(self.source, self.kind, self.data_path, self.rank,
                                  self.world_size, timed=self.timed, loads=self.loads,
                                  skips=self.skips)
        return WorkerInstances(self._supervisor("instances", self.source, self.kind, pass_no))

    def _loads_of(self, data: Any) -> LoadOptions | None:
        """The load stage for ``data``: the source's; none for a cache of instances (they
        were loaded when the cache filled)."""
        return self.loads if data is self.source else None
