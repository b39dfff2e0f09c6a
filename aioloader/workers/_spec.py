"""WorkerSpec: everything one worker needs, as data (pickled as is for spawn and forkserver)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from .._config import Workers
from ..pipeline._loads import LoadOptions
from ..pipeline._pipeline import BatchOptions, Pipeline
from ..plans._planning import worker_seed
from ..plans._position import ShardPosition
from ..plans._sources import Kind

Plan = Literal["stream", "instances", "index"]


@dataclass(frozen=True)
class WorkerSpec:
    """``workers``: the loader's config part of that name, as it is."""

    source: Any
    kind: Kind
    data_path: Any
    plan: Plan
    options: BatchOptions
    collate_fn: Callable[[list[Any]], Any] | None
    workers: Workers
    worker_id: int
    rank: int
    world_size: int
    seed: int
    first_pass: int
    parent_pid: int
    starts: tuple[ShardPosition, ...] | None = None  # per worker: where a resumed stream starts
    loads: LoadOptions | None = None  # the source yields keys; this stage loads them

    def parts(self) -> dict[str, Any]:
        """What spawn and forkserver pickle of the user's, by the names they were given."""
        return {"source": self.source, "collate_fn": self.collate_fn, "options": self.options,
                "worker_init_fn": self.workers.init_fn}

    def for_worker(self, worker_id: int) -> WorkerSpec:
        return replace(self, worker_id=worker_id)

    def starting_at(self, start: ShardPosition) -> WorkerSpec:
        """This worker's spec, its stream starting at ``start`` (a restart)."""
        starts = list(self.starts or
                      [ShardPosition(self.first_pass)] * self.workers.num_workers)
        starts[self.worker_id] = start
        return replace(self, starts=tuple(starts))

    def start(self) -> ShardPosition:
        """Where this worker's stream starts (a resumed loader's position, issue 10)."""
        if self.starts is None:
            return ShardPosition(self.first_pass)
        return self.starts[self.worker_id]

    def seed_for(self, pass_no: int) -> int:
        return worker_seed(self.seed, pass_no, self.rank, self.worker_id)

    def pipeline(self) -> Pipeline:
        return Pipeline(self.source, self.kind, self.data_path, self.options, self.collate_fn,
                        self.loads, self.worker_id, self.workers.num_workers, self.rank,
                        self.world_size)
