"""torch.distributed: this process's rank, and the loader's own agreement between ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Topology:
    """Where this process stands: rank ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # the loader's own gloo group, for even_batches

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def topology(even_batches: bool) -> Topology:
    """The current process group's view; a private group when ranks must agree.

    The loader's collectives run on a group of their own, so that they can never interleave
    with the training loop's (DDP's gradient all-reduce) in a different order on two ranks.
    Creating it is itself collective: every rank must construct its loaders in the same order.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Topology()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo") if (even_batches and world > 1) else None
    return Topology(rank, world, group)


def maxima(topo: Topology, values: Sequence[int]) -> list[int]:
    """Each value's maximum over the ranks (one collective for all; a flag's: whether it is
    set on any rank); blocking."""
    import torch.distributed as dist

    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=topo.group)
    return [int(v) for v in t.tolist()]


def share_size(n: int, rank: int, world: int, *, even: bool, drop_last: bool) -> int:
    """How many of ``n`` samples ``shard_order`` gives rank ``rank``, without building it."""
    if even:
        return n // world if drop_last else -(-n // world)
    return len(range(rank, n, world))


def shard_order(order: torch.Tensor, rank: int, world: int, *, even: bool,
                drop_last: bool) -> torch.Tensor:
    """This rank's share of ``order`` (a 1-D index tensor), like DistributedSampler.

    ``even``: every rank gets the same number, by wrapping around (a few samples twice)
    or, with ``drop_last``, by leaving the remainder out. Otherwise rank r takes r, r+world, ...
    """
    n = order.numel()
    if even and n % world:
        if drop_last:
            order = order[: n - n % world]
        else:
            pad = world - n % world
            order = torch.cat([order, order.repeat(pad // n + 1)[:pad]])
    return order[rank::world]


def even_out(batches: Sequence[list[int]], target: int) -> Sequence[list[int]]:
    """``batches`` repeated from the start until there are ``target`` of them."""
    if not batches or len(batches) >= target:
        return batches
    return [*batches, *(batches[k % len(batches)] for k in range(target - len(batches)))]
