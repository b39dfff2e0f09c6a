"""Setup: the one place a loader's plans, producers and workers are made, from its config
and seed."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._config import LoaderConfig
from .._errors import ResumeError
from ..pipeline._loads import LoadOptions, SkipLog
from ..plans import _planning
from ..plans._distributed import maxima
from ..plans._planning import PlanSpec, Sharding, count_batches, plan_epoch, sharding, worker_seed
from ..plans._position import (
    PASS_START,
    BlockStart,
    Frontier,
    Level,
    ShardPosition,
    StreamPosition,
    delivered_in_block,
)
from ..plans._reshape import local_plan, split_plan
from ..plans._sources import Kind, is_stateful, splits_itself
from ..plans._state import ResumePoint
from ..workers._local import LocalIndex, LocalInstances, LocalStream
from ..workers._phases import RestartBudget
from ..workers._producers import (
    CachedInstances,
    Plan,
    Pool,
    WorkerIndex,
    WorkerInstances,
    WorkerStream,
)
from ..workers._spec import Plan as Role
from ..workers._spec import WorkerSpec
from ..workers._standby import StandbyPool
from ..workers._supervisor import Supervisor
from ._session import Producer


@dataclass(frozen=True)
class Setup:
    """How a loader's producers (and their workers) are made, from its config and seed: only
    here are worker specs built and supervisors made."""

    config: LoaderConfig
    seed: int
    budget: RestartBudget  # max_worker_restarts
    skips: SkipLog  # keys skipped on error, per loader
    standby: StandbyPool | None  # spawn: warm processes for the first workers (issue 13)
    pads: dict[int, int]  # a cached reader's repeats planned (even_batches), by pass

    @functools.cached_property
    def plan_spec(self) -> PlanSpec:
        """What an epoch's plan is a function of (with the pass number)."""
        b, topo = self.config.batching, self.config.topo
        wrapped = b.sampler is not None  # batch_size and drop_last are in the batch sampler
        return PlanSpec(
            batch_size=None if wrapped else b.batch_size,
            drop_last=False if wrapped else b.drop_last, shuffle=b.shuffle,
            sampler=b.batch_sampler, seed=self.seed, rank=topo.rank,
            world_size=topo.world_size, even_batches=b.even_batches)

    def count(self, data: Sequence[Any]) -> int:
        """Batches per epoch over ``data``: the dataset, or a reader's cached instances."""
        return count_batches(self.plan_spec, data, shared=data is self.config.source)

    def producer(self, first_pass: int, resume: ResumePoint | None,
                 cache: CachedInstances | None) -> Producer:
        """What a session starting at pass ``first_pass`` drives (from ``resume``, where it
        belongs to that pass): a stream, or index batches of the dataset or of ``cache``
        (a reader's instances, read already)."""
        c = self.config
        if c.lazy:
            start = StreamPosition.begin(first_pass, c.shards)
            if resume is not None and resume.stream is not None:
                start = resume.stream
            return self._stream(start)
        history, spec = resume.history if resume is not None else (), self.plan_spec
        if c.kind is Kind.MAP:
            data: Any = c.source
            plan = self._plan(data)
            if history:
                plan = _first_pass(plan, first_pass,
                                   lambda: split_plan(spec, data, first_pass, history))
        else:
            assert cache is not None, "a cached reader's producer needs its cache"
            data = cache
            plan = self._plan(cache)
            if history:
                plan = _first_pass(plan, first_pass, lambda: local_plan(
                    spec, first_pass, history, len(cache), c.shards))
            elif resume is not None and resume.instances not in (None, len(cache)):
                raise ResumeError(
                    f"the state was taken over {resume.instances} instances, but the reader "
                    f"now gives {len(cache)}: the data changed, so the position in the epoch "
                    "means other batches")
        ahead = sharding(spec, shared=True) is not Sharding.AS_IS
        skip = resume.in_pass if resume is not None else 0  # delivered of the first pass
        if c.workers.num_workers == 0:
            return LocalIndex(data, plan, first_pass, c.collate_fn, timed=c.workers.progress,
                              skip=skip, loads=self._loads_of(data), skips=self.skips,
                              ahead=c.workers.slots, plan_ahead=ahead,
                              on_loop=c.workers.fetch_on_loop)
        return WorkerIndex(self._supervisor("index", data, Kind.MAP, first_pass), plan,
                           first_pass, c.workers.slots, plan_ahead=ahead, skip=skip)

    def reshape_refusal(self) -> str | None:
        """Why a state taken on another shape (world size; a stream's workers) cannot resume
        here; None: the rest of its epoch can be dealt again (``_reshape``)."""
        c = self.config
        if self._reshapes_itself():
            return None
        if c.kind is not Kind.MAP and any(splits_itself(c.source, c.kind)):
            # Lazy or cached alike: a cache puts its workers' instances back together one
            # by one, the source's own order only if it splits itself one by one.
            return ("the source splits itself between the workers or ranks, so the loader "
                    "cannot tell which shard read which instance: resume on the num_workers "
                    "and world size the state was taken with (or let the loader shard a "
                    "reader; a reader with a reshape_state(), as the format readers have, "
                    "resumes on another shape when read lazily, max_instances_in_memory=N, "
                    "without a BatchSampler)")
        if c.lazy:
            if c.batching.options.sampler is not None:
                return ("a BatchSampler's blocks depend on their instances, so the batches a "
                        "stream delivered cannot be told without reading them again: resume "
                        "on the num_workers and world size the state was taken with")
            return None
        if sharding(self.plan_spec, shared=True) is Sharding.AS_IS:
            return ("a batch_sampler of your own deals the samples between the ranks, so only "
                    "it could deal the rest of the epoch again: resume on the same world size, "
                    "or let the loader sample (batch_size=, shuffle=)")
        if c.kind is not Kind.MAP and self.plan_spec.sampler is not None:
            return ("a BatchSampler over a cached reader batches each rank's own "
                    "instances, which other ranks never see: resume on the same world size")
        return None

    def _reshapes_itself(self) -> bool:
        """A stream of a reader that splits itself and says how a pass continues on another
        shape (``reshape_state``, as the format readers do), without a BatchSampler (whose
        blocks depend on their instances: what they delivered cannot be replayed)."""
        c = self.config
        return (c.lazy and c.kind is Kind.READER and callable(
            getattr(c.source, "reshape_state", None)) and is_stateful(c.source)
            and any(splits_itself(c.source, c.kind)) and c.batching.options.sampler is None)

    def reframe(self, states: list[ResumePoint]) -> StreamPosition:
        """This loader's stream position from every rank's (``states``, by rank) on another
        shape: its shards begin at the earliest block start of the old ones, and skip what
        the old ones delivered (a :class:`Frontier`); a reader that splits itself is told
        where the old shards stood, and deals the rest itself."""
        if self._reshapes_itself():
            return self._reframe_reader(states)
        old = list(self._old_shards(states))
        earlier = next((p.frontier for p, _, _ in old if p.frontier is not None), None)
        level = Level(states[0].world_size * (states[0].shards or 1),
                      tuple(replace(p, frontier=None) if pending else None
                            for p, pending, _ in old),
                      tuple(seed for _, _, seed in old))
        options = self.config.batching.options
        frontier = (earlier or Frontier(())).extended(level, options)
        frontier.delivered(options)  # what cannot be replayed: here
        start = frontier.restart() or PASS_START  # (no shard left: every instance is skipped)
        return self._restarted(states, start, frontier)

    def _reframe_reader(self, states: list[ResumePoint]) -> StreamPosition:
        """Every new shard starts the pass at the reader's ``reshape_state``: the old
        shards' reader states at their blocks' starts and what of those blocks they
        delivered (replayed as the loader replays a block). The reader deals the rest."""
        options = self.config.batching.options
        lanes: list[tuple[Any, list[int]] | None] = [
            (p.start.state, delivered_in_block(options, p, seed) if p.batches else [])
            if pending else None  # None: its pass was over
            for p, pending, seed in self._old_shards(states)]
        return self._restarted(states, BlockStart(0, 0, self.config.source.reshape_state(lanes)))

    def _old_shards(self, states: list[ResumePoint]
                    ) -> Iterator[tuple[ShardPosition, bool, int]]:
        """Every old shard, rank by rank: its position, whether its pass was still under
        way, and its pass's seed."""
        per_rank, pass_no = states[0].shards or 1, states[0].pass_no
        for point in states:
            stream = point.stream or StreamPosition.begin(pass_no, per_rank)
            for w, position in enumerate(stream.shards):
                yield (position, w in stream.pending,
                       worker_seed(self.plan_spec.seed, pass_no, point.rank, w))

    def _restarted(self, states: list[ResumePoint], start: BlockStart,
                   frontier: Frontier | None = None) -> StreamPosition:
        """Every new shard at ``start`` of the states' pass."""
        n = self.config.shards
        return StreamPosition(
            tuple(ShardPosition(states[0].pass_no, start, frontier=frontier) for _ in range(n)),
            0, tuple(range(n)),
            max((p.stream.produced for p in states if p.stream is not None), default=0))

    def _plan(self, data: Sequence[Any]) -> Plan:
        """Each pass's index batches of ``data``: the dataset (shared by the ranks), or a
        cached reader's instances (each rank's own, evened out under ``even_batches``)."""
        spec, topo = self.plan_spec, self.config.topo
        shared = data is self.config.source
        if shared or not (topo.distributed and self.config.batching.even_batches):
            if sharding(spec, shared=shared) is Sharding.AS_IS:
                return lambda pass_no: _planning.Drawn(spec.sampler)  # drawn as due
            return lambda pass_no: plan_epoch(spec, data, pass_no, shared=shared)

        target: list[int] = []  # agreed once per cache, by the first plan of the session
        own = count_batches(spec, data, shared=False)
        pads = self.pads

        def agreed(pass_no: int) -> Sequence[list[int]]:  # in a thread, never from len()
            if not target:
                target.append(maxima(topo, [own])[0])
            if own:  # the repeats of the plan's first batches (counted at the pass's end)
                pads[pass_no] = target[0] - own
            return plan_epoch(spec, data, pass_no, shared=False, target_batches=target[0])

        return agreed

    def _supervisor(self, role: Role, source: Any, kind: Kind, first_pass: int,
                    starts: tuple[ShardPosition, ...] | None = None) -> Pool:
        c, w = self.config, self.config.workers
        if role == "instances":  # a cache-filling pass is read once: recycling is for epochs
            w = replace(w, max_batches=None, max_rss=None)
        spec = WorkerSpec(
            source=source, kind=kind, data_path=c.data_path, plan=role,
            options=c.batching.options, collate_fn=c.collate_fn, workers=w, worker_id=0,
            rank=c.topo.rank, world_size=c.topo.world_size, seed=self.seed,
            first_pass=first_pass,
            parent_pid=os.getpid() if w.start_method != "forkserver" else 0,
            starts=starts, loads=self._loads_of(source))
        if w.worker_type == "ray":  # actors on a Ray cluster, behind the same interface
            from ..workers._ray import RaySupervisor  # Ray is optional: imported only when used

            return RaySupervisor(spec, budget=self.budget, skips=self.skips)
        return Supervisor(spec, budget=self.budget, skips=self.skips, standby=self.standby)

    def _stream(self, start: StreamPosition) -> Producer:
        """Batches of passes over a streaming source, each worker over its shard, from
        ``start`` on (``StreamPosition.begin(pass, shards)``: a pass's start)."""
        c, spec = self.config, self.plan_spec
        if c.workers.num_workers == 0:
            # worker 0's seeds: one shard gives the same batches in or out of a worker
            return LocalStream(c.source, c.kind, c.data_path, c.batching.options, c.collate_fn,
                               lambda pass_no: worker_seed(spec.seed, pass_no, spec.rank, 0),
                               start.shards[0], c.topo.rank,
                               c.topo.world_size, timed=c.workers.progress,
                               produced=start.produced, loads=c.loads, skips=self.skips)
        first_pass = min(p.pass_no for p in start.shards)
        sup = self._supervisor("stream", c.source, c.kind, first_pass, start.shards)
        return WorkerStream(sup, start)

    def instances(self, pass_no: int) -> Producer:
        """One pass of a streaming source's instances, in chunks (to fill a cache)."""
        c = self.config
        if c.workers.num_workers == 0:
            return LocalInstances(c.source, c.kind, c.data_path, c.topo.rank,
                                  c.topo.world_size, timed=c.workers.progress, loads=c.loads,
                                  skips=self.skips)
        return WorkerInstances(self._supervisor("instances", c.source, c.kind, pass_no))

    def _loads_of(self, data: Any) -> LoadOptions | None:
        """The load stage for ``data``: the source's; none for a cache of instances (they
        were loaded when the cache filled)."""
        return self.config.loads if data is self.config.source else None


def _first_pass(plan: Plan, resumed: int, first: Callable[[], Sequence[list[int]]]) -> Plan:
    """``plan``, but pass ``resumed`` (dealt again after a resume on another shape) is
    ``first()``."""
    return lambda pass_no: first() if pass_no == resumed else plan(pass_no)
