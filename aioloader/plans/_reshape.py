"""Resuming index batches on another number of ranks: what an interrupted pass left.

A rank's plan is a pure function of (seed, pass, rank, world size), so the ranks' batch
counts (a :class:`Progress`, one per change of shape: the history) say which samples were
delivered (docs/architecture.md, "Resuming on another shape"). Plans are made in a thread;
a mask over the data is one byte a sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._errors import ResumeError
from ._planning import PlanSpec, count_batches, deal, global_order, plan_epoch
from ._samplers import Batches, LazyPlan


@dataclass(frozen=True)
class Progress:
    """The ranks' progress in one pass when their states were taken.

    Rank r of ``world_size`` had delivered ``batches[r]`` batches of the pass; for a cached
    reader, it held ``instances[r]`` instances (None for a dataset).
    """

    world_size: int
    batches: tuple[int, ...]
    instances: tuple[int, ...] | None = None
    group: int = 1  # a cached reader's: shards per rank (see ``held``)

    def to_data(self) -> list[Any]:
        return [self.world_size, list(self.batches),
                None if self.instances is None else list(self.instances), self.group]

    @classmethod
    def from_data(cls, data: Any) -> Progress:
        world, batches, instances, group = data
        progress = cls(int(world), tuple(int(b) for b in batches),
                       None if instances is None else tuple(int(n) for n in instances),
                       int(group))
        if progress.world_size < 1 or len(progress.batches) != progress.world_size or (
                progress.instances is not None
                and len(progress.instances) != progress.world_size):
            raise ValueError(f"a progress of {progress.world_size} rank(s) holds "
                             f"{len(progress.batches)} batch count(s)")
        if min(progress.batches) < 0 or min(progress.instances or (0,)) < 0 or (
                progress.group < 1):
            raise ValueError("a progress holds a count below 0")
        return progress

    @property
    def total(self) -> int:
        """A cached reader's instances across the ranks."""
        assert self.instances is not None
        return sum(self.instances)


History = tuple[Progress, ...]


def split_plan(spec: PlanSpec, data: Sequence[Any], epoch: int,
               history: History) -> Sequence[list[int]]:
    """Rank ``spec.rank``'s batches of what ``history`` left of SPLIT epoch ``epoch``."""
    order = global_order(spec, len(data), epoch)
    for progress in history:
        delivered = torch.zeros(len(data), dtype=torch.bool)
        for r, taken in enumerate(progress.batches):
            rank_spec = replace(spec, rank=r, world_size=progress.world_size)
            _mark(delivered, deal(rank_spec, data, epoch, order), taken, epoch, progress)
        order = order[~delivered[order]]
    return deal(spec, data, epoch, order)


def held(total: int, rank: int, world: int, group: int) -> torch.Tensor:
    """The reader's instances rank ``rank`` of ``world`` caches, in its cache's order, when
    the loader shards the reader in ``group`` shards per rank (one per worker): shard
    ``rank * group + w`` of ``world * group`` keeps instances ``rank * group + w``,
    ``+ world * group``, ... (``_sources.shard_spec``), and a rank's shards are interleaved
    back into the reader's order."""
    items = torch.arange(total)
    return items[items % (world * group) // group == rank]


def cache_size(instances: int | None, history: History, rank: int, world: int,
               group: int) -> int | None:
    """How many instances rank ``rank`` of ``world`` caches: ``instances`` where a state
    says so; in a pass resumed on a new shape, its share of the instances the history
    counts (None: not known before the reader is read)."""
    if instances is not None or not history or history[0].instances is None:
        return instances
    return len(held(history[0].total, rank, world, group))


def local_plan(spec: PlanSpec, epoch: int, history: History, cached: int,
               group: int) -> Sequence[list[int]]:
    """Rank ``spec.rank``'s batches (indices into its cache of ``cached`` instances, read in
    ``group`` shards) of what ``history`` left of LOCAL epoch ``epoch``."""
    total = history[0].total
    rank, world = spec.rank, spec.world_size
    mine = held(total, rank, world, group)
    if cached != len(mine):
        raise ResumeError(
            f"the states were taken over {total} instances in all, so rank {rank} of {world} "
            f"should hold {len(mine)}, but the reader gave it {cached}: the data changed, or the "
            "reader shards itself by rank (resuming on another world size needs the "
            "loader's own sharding)")
    delivered = torch.zeros(total, dtype=torch.bool)
    for progress in history:
        left = [_left(delivered, held(total, r, progress.world_size, progress.group))
                for r in range(progress.world_size)]
        target = _target(spec, progress.world_size, left)  # (`left` is taken before marking)
        for r, (items, taken) in enumerate(zip(left, progress.batches, strict=True)):
            rank_spec = replace(spec, rank=r, world_size=progress.world_size)
            plan = plan_epoch(rank_spec, range(len(items)), epoch, shared=False,
                              target_batches=target)
            positions = torch.zeros(len(items), dtype=torch.bool)
            _mark(positions, plan, taken, epoch, progress)
            delivered[items[positions]] = True
    left = [_left(delivered, held(total, r, world, group)) for r in range(world)]
    target = _target(spec, world, left)
    if target and not len(left[rank]) and cached:
        # Nothing is left here, but the others have batches to give: as in any even pass,
        # this rank repeats instances of its own (it must take part in every step).
        whole = plan_epoch(spec, range(cached), epoch, shared=False, target_batches=target)
        return list(whole[:target])
    plan = plan_epoch(spec, range(len(left[rank])), epoch, shared=False,
                      target_batches=target)
    return _InCache(plan, torch.searchsorted(mine, left[rank]))


def _left(delivered: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """``items`` that were not delivered."""
    return items[~delivered[items]]


def _target(spec: PlanSpec, world: int, left: list[torch.Tensor]) -> int | None:
    """The batch count ranks agree on under ``even_batches`` (what ``maxima`` agrees on
    in a pass that was not resumed): computed here, since every rank's share is known."""
    if world == 1 or not spec.even_batches:
        return None
    return max(count_batches(replace(spec, rank=r, world_size=world), range(len(items)),
                             shared=False) for r, items in enumerate(left))


def _mark(delivered: torch.Tensor, plan: Sequence[list[int]], taken: int, epoch: int,
          progress: Progress) -> None:
    if taken > len(plan):
        raise ResumeError(
            f"a state says {taken} batches of epoch {epoch} were delivered on a rank of "
            f"{progress.world_size}, but that rank's epoch has {len(plan)}: the data or "
            "the arguments changed since the states were taken")
    if isinstance(plan, Batches):
        delivered[plan.head(taken)] = True
        return
    for batch in plan[:taken]:
        delivered[batch] = True


class _InCache(LazyPlan):
    """A plan over what is left of a cache, as indices into the cache itself."""

    def __init__(self, plan: Sequence[list[int]], where: torch.Tensor) -> None:
        self.plan, self.where = plan, where

    def __len__(self) -> int:
        return len(self.plan)

    def batch(self, i: int) -> list[int]:
        batch: list[int] = self.where[self.plan[i]].tolist()
        return batch
