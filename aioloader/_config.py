"""LoaderConfig: a DataLoader's arguments, checked once and frozen, in four parts, every
torch alias resolved (docs/architecture.md, "The config")."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import torch
import torch.utils.data
from torch.utils.data import IterDataPipe
from torch.utils.data.graph_settings import apply_shuffle_settings

from ._errors import FixedOptionError
from ._options import check_each, check_load_rules, check_rules
from .pipeline._collate import Unbatched
from .pipeline._loads import LoadOptions, load_options
from .pipeline._pipeline import BatchOptions
from .plane._device import can_pin
from .plans._distributed import Topology, topology
from .plans._samplers import BatchSampler
from .plans._sources import Kind, classify, splits_itself


@dataclass(frozen=True)
class Batching:
    """What an epoch's batches are."""

    batch_size: int | None  # as given: with ``sampler``, inside ``batch_sampler`` too
    drop_last: bool
    shuffle: bool
    batch_sampler: Any  # the user's, or torch's BatchSampler over ``sampler``
    sampler: Any  # torch's ``sampler=``, as given
    batches_per_epoch: int | None
    max_instances_in_memory: int | None  # None: a reader's instances are cached
    even_batches: bool

    @property
    def options(self) -> BatchOptions:
        """What a worker's batcher needs."""
        sampler = self.batch_sampler
        return BatchOptions(
            batch_size=self.batch_size, drop_last=self.drop_last, shuffle=self.shuffle,
            sampler=sampler if isinstance(sampler, BatchSampler) else None,
            chunk_size=self.max_instances_in_memory)


@dataclass(frozen=True)
class Workers:
    """Where batches are built: how many workers, of what kind, and their limits."""

    num_workers: int
    worker_type: str  # "process", "thread" or "ray"
    start_method: str  # torch's multiprocessing_context resolved
    nice: int  # worker_nice
    slots: int  # batches in flight per worker: prefetch, or more for the load stage
    zero_copy: bool
    max_restarts: int
    max_batches: int | None  # max_batches_per_worker
    max_rss: int | None  # max_worker_rss
    init_fn: Callable[[int], object] | None  # torch's worker_init_fn
    persistent: bool  # persistent_workers
    progress: bool  # a timeout is set: workers report progress, nothing runs inline
    ray_options: Mapping[str, Any] | None = None  # worker_type="ray": each actor's options
    # num_workers=0 under ``async for``: fetch on the caller's loop, not the loader's thread
    fetch_on_loop: bool = False

    @property
    def threaded(self) -> bool:
        return self.worker_type == "thread"

    @property
    def warm_start(self) -> str | None:
        """The start method whose interpreters start when the loader is made (spawn's
        standbys, the forkserver), so that their imports overlap the script's set-up."""
        if (self.num_workers == 0 or self.worker_type != "process"
                or self.start_method == "fork"):
            return None
        return self.start_method


@dataclass(frozen=True)
class Output:
    """How batches are handed over, and what the consumer is told."""

    device: torch.device | None
    pin: bool  # pin_memory=True where an accelerator can use it
    quiet: bool | None
    timeout: float | None  # torch's timeout=0 is None
    log_every: float | None


@dataclass(frozen=True)
class LoaderConfig:
    """A DataLoader's arguments, checked, with every alias resolved."""

    source: Any
    kind: Kind
    data_path: Any
    collate_fn: Callable[[list[Any]], Any] | None
    batching: Batching
    workers: Workers
    loads: LoadOptions | None
    output: Output
    # every argument as the loader keeps it, for its attributes: checked (numpy ints as
    # ints), torch's aliases resolved, torch's ``batch_size`` (None with a batch sampler or
    # unbatched) and ``batch_sampler`` (over ``sampler``). Read-only by type; a dict, so
    # that a config still copies and pickles.
    arguments: Mapping[str, Any]
    seed: int | None  # the base seed as given (0 across ranks); None: drawn at the first epoch
    topo: Topology

    @property
    def lazy(self) -> bool:
        """A stream read as it goes (``max_instances_in_memory`` set)."""
        return self.kind is not Kind.MAP and self.batching.max_instances_in_memory is not None

    @property
    def cached(self) -> bool:
        """A stream read once into memory, then batched from there."""
        return self.kind is not Kind.MAP and self.batching.max_instances_in_memory is None

    @property
    def shards(self) -> int:
        """How many shards a stream is read in (one per worker; one in this process)."""
        return max(self.workers.num_workers, 1)

    @property
    def shape_shards(self) -> int | None:
        """The shards a state's position depends on. A stream is read in one shard per
        worker. So is a cached reader on several ranks: a rank caches its workers' shards
        (another num_workers: other instances), and a cached source that splits itself
        between workers: its workers' instances are put back together one by one, which is
        its own order only if it splits itself one by one (contiguous ranges, as torch's
        IterableDataset docs split, come back in another order on another num_workers).
        Index batches are the same whatever the number of workers."""
        if self.lazy:
            return self.shards
        if self.cached and (self.topo.distributed or splits_itself(self.source, self.kind)[0]):
            return self.shards
        return None

    def fingerprint(self) -> dict[str, Any]:
        """The arguments a state depends on, as data (the seed is checked apart)."""
        c, b = self, self.batching
        return {
            "source": c.kind.value,
            "cached": c.cached,
            "batch_size": b.batch_size,
            "drop_last": b.drop_last,
            "shuffle": b.shuffle,
            "batch_sampler": None if b.batch_sampler is None
            else type(b.batch_sampler).__qualname__,
            "batches_per_epoch": b.batches_per_epoch,
            "max_instances_in_memory": b.max_instances_in_memory,
            "rank": c.topo.rank,
            "world_size": c.topo.world_size,
            "even_batches": b.even_batches,
            "shards": c.shape_shards,
            "dataset_len": len(c.source) if c.kind is Kind.MAP else None,
        }

    @property
    def keeps_workers(self) -> bool:
        """Whether a completed epoch leaves its workers up for the next one."""
        return self.workers.persistent or self.workers.num_workers == 0


def build_config(reader: Any, data_path: Any = None, **arguments: Any) -> LoaderConfig:
    """The config for ``DataLoader(reader, data_path, **arguments)``: ``TypeError`` for a
    wrong type, ``ValueError`` for a wrong value or combination, each naming the argument."""
    kind = classify(reader)
    a = check_each(kind, data_path, arguments)
    check_rules(kind, a)
    if isinstance(reader, IterDataPipe):
        if a["worker_type"] == "thread" and a["num_workers"] > 1:
            raise ValueError(
                f"worker_type='thread' with num_workers={a['num_workers']} cannot read an "
                "IterDataPipe: a datapipe allows one iterator at a time and thread workers "
                "share the one object. Use worker_type='process' (each worker reads its own "
                "copy, as torch's workers do) or num_workers=1")
        # torch hands shuffle to a datapipe's own Shuffler nodes and streams the datapipe;
        # it is never read into memory to be shuffled whole (test_dataloader.py's
        # test_multiprocessing_iterdatapipe)
        reader = apply_shuffle_settings(reader, shuffle=arguments["shuffle"])
        a["shuffle"] = False
    loads = load_options(reader, kind, load_fn=a["load_fn"], concurrency=a["concurrency"],
                         ordered=a["ordered"], retries=a["retries"], on_error=a["on_error"])
    check_load_rules(loads, a)
    batch_sampler, batch_size, collate_fn = a["batch_sampler"], a["batch_size"], a["collate_fn"]
    if batch_sampler is not None:
        batch_size = None  # torch's loader.batch_size: the batch sampler decides
    elif batch_size is None:
        # torch's batch_size=None: planned as batches of one, each undone by Unbatched.
        batch_size, collate_fn = 1, Unbatched(collate_fn)
    chunk = a["max_instances_in_memory"]
    if kind is Kind.ITERABLE and chunk is None and batch_sampler is None and not a["shuffle"]:
        # torch's IterableDataset: streamed, each worker batching its own instances, the
        # batches handed over round robin (the lazy mode does exactly that). What torch
        # refuses (shuffle=True, an aioloader.BatchSampler) reads it into memory first.
        chunk = batch_size
    if a["sampler"] is not None:
        # torch's auto-batching, and the path a user's batch sampler takes (planned when its
        # epoch starts, never split again across ranks): no second planner.
        batch_sampler = torch.utils.data.BatchSampler(a["sampler"], batch_size, a["drop_last"])
    batching = Batching(
        batch_size=batch_size, drop_last=a["drop_last"], shuffle=a["shuffle"],
        batch_sampler=batch_sampler, sampler=a["sampler"],
        batches_per_epoch=a["batches_per_epoch"],
        max_instances_in_memory=chunk, even_batches=a["even_batches"])
    workers = Workers(
        num_workers=a["num_workers"], worker_type=a["worker_type"],
        start_method=a["start_method"], nice=a["worker_nice"],
        slots=_slots(a["prefetch"], batch_size, kind, loads), zero_copy=a["zero_copy"],
        max_restarts=a["max_worker_restarts"], max_batches=a["max_batches_per_worker"],
        max_rss=a["max_worker_rss"], init_fn=a["worker_init_fn"],
        persistent=a["persistent_workers"], progress=a["timeout"] is not None,
        ray_options=a["ray_options"], fetch_on_loop=a["fetch_on_loop"])
    output = Output(device=a["cuda_device"],
                    pin=a["pin_memory"] and _can_pin(a["pin_memory_device"]),
                    quiet=a["quiet"], timeout=a["timeout"], log_every=a["log_every"])
    kept = a | {"reader": reader, "data_path": data_path, "batch_sampler": batch_sampler,
                "batch_size": None if a["batch_sampler"] is not None else a["batch_size"],
                "concurrency": None if loads is None else loads.concurrency}
    topo = topology(a["even_batches"])
    return LoaderConfig(
        source=reader, kind=kind, data_path=data_path, collate_fn=collate_fn,
        batching=batching, workers=workers, loads=loads, output=output, arguments=kept,
        seed=_base_seed(a["seed"], a["generator"], topo), topo=topo)


def _slots(prefetch: int, batch_size: int | None, kind: Kind, loads: LoadOptions | None) -> int:
    """Batches in flight per worker: with a load stage over index batches, enough of them
    that ``concurrency`` loads can be in flight across them."""
    if loads is None or kind is not Kind.MAP:
        return prefetch
    return max(prefetch, -(-loads.concurrency // (batch_size or 1)) + 1)


def _base_seed(seed: int | None, generator: torch.Generator | None, topo: Topology) -> int | None:
    if seed is not None:
        return seed
    if generator is None and topo.distributed:
        return 0  # ranks must agree on one shuffle: like DistributedSampler, seed 0
    return None  # drawn when the first epoch starts: draw_seed


def draw_seed(generator: torch.Generator | None) -> int:
    """torch's base seed: one draw from ``generator``, or from torch's default generator
    (so ``torch.manual_seed`` decides it), 63 bits."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _can_pin(device: str) -> bool:
    """torch's rule for ``pin_memory=True``: without an accelerator it warns and pins
    nothing (the batches are still good); ``pin_memory_device`` is deprecated there and
    ignored with a warning, here too."""
    if device:
        warnings.warn(f"pin_memory_device is deprecated in torch, and ignored here: batches "
                      f"are pinned for the current accelerator (not {device!r})",
                      stacklevel=4)
    if can_pin():
        return True
    warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then "
                  "device pinned memory won't be used.", stacklevel=4)
    return False


T = TypeVar("T")


class Option(Generic[T]):
    """A loader's option as a read-only attribute: the argument of its name, as the loader
    keeps it. Fixed when the loader is built (issue 20: a timeout set afterwards armed the
    consumer's timer, not the workers' progress reports)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Option[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> T | Option[T]:
        if obj is None:
            return self
        config: LoaderConfig = obj.config  # type: ignore[attr-defined]
        return config.arguments[self._name]  # type: ignore[no-any-return]

    def __set__(self, obj: object, value: object) -> None:
        raise fixed(self._name, value)


def fixed(name: str, value: object) -> FixedOptionError:
    return FixedOptionError(
        f"DataLoader.{name} is fixed when the loader is built (its workers, plans and "
        f"timers were made from it): build a new DataLoader(..., {name}={value!r})")
