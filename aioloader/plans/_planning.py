"""Epoch plans: which indices form each batch of an epoch on this rank; pure, no I/O.

No loop, no collective (issue 9: `len()` ran one), safe in a thread: what ranks must agree on
(a cached reader's batch count under `even_batches`) the caller agrees on once and passes in
as `target_batches`.
"""

from __future__ import annotations

import collections
import enum
import itertools
import operator
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from ._distributed import even_out, shard_order, share_size
from ._samplers import (
    Batches,
    BatchSampler,
    InOrder,
    derive_seed,
    index_batches,
    num_batches,
    torch_generator,
)

# Two threads must not iterate one user sampler at once.
_SAMPLER_LOCK = threading.Lock()


class Sharding(enum.Enum):
    """How an epoch's samples are divided between torch.distributed ranks."""

    SPLIT = "split"  # one plan over shared data, dealt DistributedSampler-style by the loader
    LOCAL = "local"  # the data is this rank's own shard (cached reader): plan it all
    AS_IS = "as_is"  # a user's sampler: exactly what it yields on this rank, never split again


@dataclass(frozen=True)
class PlanSpec:
    """What an epoch's plan depends on, besides the data and the epoch number.

    `sampler` is None (plan from batch_size/shuffle/drop_last), an `aioloader.BatchSampler`,
    or a user's index-batch sampler (a torch `BatchSampler`, any iterable of index lists).

    Examples:
        PlanSpec(batch_size=32, shuffle=True, seed=7, rank=1, world_size=4)
    """

    batch_size: int | None = None
    drop_last: bool = False
    shuffle: bool = False
    sampler: Any = None
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    even_batches: bool = True


def sharding(spec: PlanSpec, *, shared: bool) -> Sharding:
    """The policy for `spec` over data every rank holds whole (`shared`) or its own shard."""
    if spec.sampler is not None and not isinstance(spec.sampler, BatchSampler):
        return Sharding.AS_IS
    return Sharding.SPLIT if shared else Sharding.LOCAL


def plan_epoch(
    spec: PlanSpec,
    data: Sequence[Any],
    epoch: int,
    *,
    shared: bool,
    target_batches: int | None = None,
) -> Sequence[list[int]]:
    """The index batches of epoch `epoch` on rank `spec.rank`; pure and thread-safe.

    `shared`: `data` is the same on every rank (a map-style dataset); False: it is this
    rank's own cached instances. Only `len(data)` is used, unless an `aioloader.BatchSampler`
    needs the instances. SPLIT deals the `global_order` like DistributedSampler (`deal`);
    AS_IS iterates the user's sampler when the epoch starts (its `set_epoch` is the user's
    job, as in torch). `target_batches`: pad with batches repeated from the start up to this
    count (what ranks agreed on); never truncates.

    Examples:
        plan_epoch(PlanSpec(batch_size=2, shuffle=True, seed=1), dataset, 3, shared=True)
    """
    policy = sharding(spec, shared=shared)
    batches: Sequence[list[int]]
    if policy is Sharding.AS_IS:
        batches = _user_batches(spec.sampler)
    elif spec.sampler is None and not spec.shuffle and spec.world_size == 1:
        assert spec.batch_size is not None  # PlanSpec checked
        batches = InOrder(len(data), spec.batch_size, spec.drop_last)
    elif policy is Sharding.SPLIT:
        batches = deal(spec, data, epoch, global_order(spec, len(data), epoch), whole=True)
    elif spec.sampler is not None:
        batches = _sampler_batches(spec, data, epoch, policy)
    else:
        assert spec.batch_size is not None  # PlanSpec checked
        batches = Batches(global_order(spec, len(data), epoch, policy), spec.batch_size,
                          spec.drop_last)
    return batches if target_batches is None else even_out(batches, target_batches)


def global_order(spec: PlanSpec, n: int, epoch: int,
                 policy: Sharding = Sharding.SPLIT) -> torch.Tensor:
    """The order of range(n) in epoch `epoch` before it is dealt to the ranks (SPLIT) or cut
    into batches (LOCAL): a permutation seeded from the epoch when the loader shuffles, else
    range order (an `aioloader.BatchSampler` shuffles each rank's share itself)."""
    if spec.sampler is None and spec.shuffle:
        return torch.randperm(n, generator=torch_generator(_epoch_seed(spec, epoch, policy)))
    return torch.arange(n)


def deal(spec: PlanSpec, data: Sequence[Any], epoch: int, order: torch.Tensor, *,
         whole: bool = False) -> Sequence[list[int]]:
    """Rank `spec.rank`'s SPLIT batches of epoch `epoch` over `order`: the epoch's
    `global_order` (`whole`), or what an interrupted epoch left of it (`_reshape`). It is
    dealt like DistributedSampler, then cut into batches (or batched by the BatchSampler)."""
    share = _dealt(spec, order)
    if spec.sampler is None:
        assert spec.batch_size is not None  # PlanSpec checked
        return Batches(share, spec.batch_size, spec.drop_last)
    instances = data if whole and spec.world_size == 1 else _Share(data, share.tolist())
    return _sampler_batches(spec, instances, epoch, Sharding.SPLIT)


def count_batches(spec: PlanSpec, data: Sequence[Any], *, shared: bool) -> int:
    """`len(plan_epoch(...))` for any epoch, without making the plan (no collective).

    For a cached reader in distributed mode, this is this rank's own count (before
    `target_batches` evens it out). A user's sampler must have `len()`.
    """
    policy = sharding(spec, shared=shared)
    if policy is Sharding.AS_IS:
        try:
            return len(spec.sampler)
        except TypeError:
            raise TypeError(
                f"batch_sampler {type(spec.sampler).__name__} has no len(): the number of "
                "batches is unknown (pass batches_per_epoch)"
            ) from None
    if spec.sampler is not None:
        sampler: BatchSampler = spec.sampler
        if policy is Sharding.SPLIT and spec.world_size > 1:
            data = _Share(data, _dealt(spec, torch.arange(len(data))).tolist())
        return sampler.get_num_batches(data)
    assert spec.batch_size is not None
    n = len(data)
    if policy is Sharding.SPLIT:
        n = share_size(n, spec.rank, spec.world_size, even=spec.even_batches,
                       drop_last=spec.drop_last)
    return num_batches(n, spec.batch_size, spec.drop_last)


def worker_seed(seed: int, epoch: int, rank: int, worker: int) -> int:
    """Worker `worker`'s seed (of rank `rank`) in epoch `epoch`, 63 bits: its RNGs' and its
    `WorkerInfo`'s, whatever runs it."""
    return derive_seed(seed, epoch, rank, worker) & ((1 << 63) - 1)


def _epoch_seed(spec: PlanSpec, epoch: int, policy: Sharding) -> int:
    # SPLIT: every rank must draw the same order. LOCAL across ranks: the same local
    # permutation on every rank would put stream neighbours (rank shards r, r+world, ...)
    # into the same global step, so each rank draws its own.
    if policy is Sharding.LOCAL and spec.world_size > 1:
        return derive_seed(spec.seed, epoch, spec.rank)
    return derive_seed(spec.seed, epoch)


def _sampler_batches(
    spec: PlanSpec, instances: Sequence[Any], epoch: int, policy: Sharding
) -> list[list[int]]:
    """A BatchSampler's batches of `instances` (a rank's `_Share`, or the data whole), as
    indices into the data."""
    local = index_batches(instances, None, drop_last=False, shuffle=False, sampler=spec.sampler,
                          rng=random.Random(_epoch_seed(spec, epoch, policy)))
    if isinstance(instances, _Share):
        return [[instances.indices[i] for i in b] for b in local]
    return local


def _user_batches(sampler: Any) -> list[list[int]]:
    # Like torch's DataLoader, the loader never calls its set_epoch: a script that resumes
    # calls sampler.set_epoch(5) itself, and the loader's own pass count must not undo it.
    drawn, batches = Drawn(sampler), list[list[int]]()
    while drawn.fill():
        batches.extend(drawn.ready)
        drawn.ready.clear()
    return batches


class Drawn:
    """A user's batch sampler's batches of one epoch, drawn as they are due, a chunk at a
    time (``fill``, in a thread: user code), as torch's iterator draws them: never the whole
    epoch at once, which cost a sampler of 10 million indices 4 s and 400 MB before its
    first batch, and never ended for an infinite one."""

    _MOST = 256  # batches drawn at a time, once the first few are out

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.ready: collections.deque[list[int]] = collections.deque()
        self._iterator: Iterator[Any] | None = None
        self._chunk = 1  # the first batch as soon as it is drawn

    def fill(self) -> bool:
        """Draw up to the next chunk into ``ready``; False at the epoch's end."""
        with _SAMPLER_LOCK:
            if self._iterator is None:
                self._iterator = iter(self.sampler)
            for batch in itertools.islice(self._iterator, self._chunk):
                try:
                    self.ready.append([_index(i) for i in batch])
                except TypeError:
                    raise TypeError(
                        f"batch_sampler {type(self.sampler).__name__} yielded {batch!r}, not a "
                        "list of indices (a torch Sampler goes inside "
                        "torch.utils.data.BatchSampler)") from None
        self._chunk = min(2 * self._chunk, self._MOST)
        return bool(self.ready)


def _index(i: Any) -> Any:
    """A sampler's item as ``dataset[item]`` is called with, in a form the wire carries: an
    int (a numpy or 0-d tensor one too), a tensor's list; anything else as it is (a key of a
    dict-like dataset; a list of indices, which ``batch_size=None`` hands over whole)."""
    if isinstance(i, torch.Tensor):
        return i.tolist()
    try:
        return operator.index(i)
    except TypeError:
        return i


def _dealt(spec: PlanSpec, order: torch.Tensor) -> torch.Tensor:
    """This rank's SPLIT share of `order`."""
    return shard_order(order, spec.rank, spec.world_size, even=spec.even_batches,
                       drop_last=spec.drop_last)


class _Share(Sequence[Any]):
    """A view of `data` at `indices`, for a BatchSampler that batches a rank's share."""

    def __init__(self, data: Sequence[Any], indices: list[int]) -> None:
        self.data, self.indices = data, indices

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return _Share(self.data, self.indices[i])
        return self.data[self.indices[i]]
