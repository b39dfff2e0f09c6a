"""What a loader can read from: readers, IterableDatasets, map-style Datasets; sharding; and
how their async iterators are started and closed."""

from __future__ import annotations

import enum
import sys
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Sequence,
)
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch.utils.data
from torch.utils.data import IterDataPipe
from torch.utils.data.graph_settings import apply_sharding

T = TypeVar("T")


@runtime_checkable
class SupportsRead(Protocol):
    """A reader: ``read(data_path)`` returns an iterable or an async iterable of instances."""

    def read(self, data_path: Any) -> Iterable[Any] | AsyncIterable[Any]: ...


class Reader:
    """Optional base class for readers.

    Set ``manual_multiprocess_sharding = True`` when ``read`` shards itself across workers
    (using :func:`aioloader.get_worker_info`), and ``manual_distributed_sharding = True`` when
    it shards itself across ``torch.distributed`` ranks; otherwise the loader does it.

    Examples:
        >>> class Numbers(Reader):
        ...     def read(self, data_path):
        ...         yield from ({"x": i} for i in range(3))
        >>> list(Numbers().read(None))
        [{'x': 0}, {'x': 1}, {'x': 2}]
    """

    manual_multiprocess_sharding: bool = False
    manual_distributed_sharding: bool = False

    def read(self, data_path: Any) -> Iterable[Any] | AsyncIterable[Any]:
        raise NotImplementedError(f"{type(self).__name__}.read(data_path) is not implemented")


class Kind(enum.Enum):
    READER = "reader"
    ITERABLE = "iterable dataset"
    MAP = "map-style dataset"


def classify(source: Any) -> Kind:
    """Which kind of source this is; a clear TypeError when it is none."""
    if isinstance(source, torch.utils.data.IterableDataset):
        return Kind.ITERABLE
    if callable(getattr(source, "read", None)):
        return Kind.READER
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        return Kind.MAP
    raise TypeError(
        f"cannot read from {type(source).__name__!r}: pass a reader (an object with "
        "read(data_path) returning an iterable or async iterable of instances), a "
        "torch.utils.data.Dataset (with __getitem__ and __len__) or a "
        "torch.utils.data.IterableDataset")


def open_pass(source: Any, kind: Kind, data_path: Any, worker: int = 0, num_workers: int = 0,
              rank: int = 0, world_size: int = 1) -> Iterable[Any] | AsyncIterable[Any]:
    """The instances of one pass over a streaming source, by worker ``worker`` of
    ``num_workers`` on rank ``rank`` of ``world_size``."""
    if kind is Kind.ITERABLE:
        if isinstance(source, IterDataPipe):
            _shard_datapipe(source, worker, num_workers, rank, world_size)
        it: Iterable[Any] = iter(source)
        return it
    stream: Iterable[Any] | AsyncIterable[Any] = source.read(data_path)
    if isinstance(stream, (Iterable, AsyncIterable)):
        return stream
    raise TypeError(
        f"{type(source).__name__}.read() returned {type(stream).__name__!r}, which is neither "
        "iterable nor async iterable: return (or yield) instances")


def is_stateful(source: Any) -> bool:
    """The source saves and restores its own position (torchdata's Stateful protocol)."""
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None))


def _shard_datapipe(source: IterDataPipe[Any], worker: int, num_workers: int, rank: int,
                    world_size: int) -> None:
    """A datapipe's ``sharding_filter`` keeps this reader's share as torch's DataLoader sets
    it (``_sharding_worker_init_fn``): share ``worker * world_size + rank`` of ``num_workers
    * world_size``; without it every worker and rank read it whole. The setting is the
    object's: several thread workers, which would share it, are refused a datapipe."""
    workers = max(num_workers, 1)
    apply_sharding(source, workers * world_size, worker * world_size + rank)


def shard_spec(source: Any, kind: Kind, worker: int, num_workers: int, rank: int,
               world_size: int) -> tuple[int, int]:
    """(index, count): this process keeps instances index, index + count, ... of a source
    the loader shards (see ``splits_itself``)."""
    if kind is Kind.ITERABLE:
        return 0, 1
    manual_workers, manual_ranks = splits_itself(source, kind)
    index, count = 0, 1
    if not manual_ranks and world_size > 1:
        index, count = rank, world_size
    if not manual_workers and num_workers > 1:
        index, count = index * num_workers + worker, count * num_workers
    return index, count


def splits_itself(source: Any, kind: Kind) -> tuple[bool, bool]:
    """Whether ``source`` splits itself (across workers, across ranks) rather than being
    sharded by the loader: an IterableDataset always (torch's rule), a reader when it says
    so (``manual_multiprocess_sharding``, ``manual_distributed_sharding``)."""
    if kind is Kind.ITERABLE:
        return True, True
    return (bool(getattr(source, "manual_multiprocess_sharding", False)),
            bool(getattr(source, "manual_distributed_sharding", False)))


async def as_async(stream: Iterable[Any]) -> AsyncIterator[Any]:
    """A sync iterable driven inline (in a worker, blocking its loop is fine)."""
    for item in stream:
        yield item


def fetch(dataset: Any, indices: Sequence[int],
          each: Callable[[], None] | None = None, *, bulk: bool = True) -> list[Any]:
    """The samples at ``indices``, in bulk when the dataset supports ``__getitems__`` (and
    ``bulk``: torch calls it only when it batches automatically).

    ``each()`` runs after every sample fetched one by one (progress, for the timeout).
    """
    getitems = getattr(dataset, "__getitems__", None) if bulk else None
    if getitems is not None:
        return list(getitems(list(indices)))
    if each is None:
        return [dataset[i] for i in indices]
    out = []
    for i in indices:
        out.append(dataset[i])
        each()
    return out


class Unhooked(Generic[T]):
    """An async iterator whose first step is taken without the loop's hooks (see
    :func:`unhooked`); closing it closes what it wraps."""

    def __init__(self, it: AsyncIterator[T]) -> None:
        self._it = it
        self._first = True

    def __aiter__(self) -> Unhooked[T]:
        return self

    def __anext__(self) -> Awaitable[T]:
        if self._first:
            self._first = False
            hooks = sys.get_asyncgen_hooks()
            sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
            try:
                return self._it.__anext__()
            finally:
                sys.set_asyncgen_hooks(*hooks)
        return self._it.__anext__()

    async def aclose(self) -> None:
        await aclose(self._it)


def unhooked(stream: AsyncIterable[T]) -> Unhooked[T]:
    """``stream``'s iterator, its first step not tied to the running loop.

    An async generator consults the loop's hooks once, at its first step: started this way,
    no loop closes it at shutdown, and its consumer closes it (:func:`aclose`).
    """
    if isinstance(stream, Unhooked):
        return stream
    return Unhooked(stream.__aiter__())


async def aclose(it: Any) -> None:
    """Close an async iterator, unless a consumer is inside it right now: the close has
    cancelled that consumer, and the cancellation unwinding through it ends it."""
    close = getattr(it, "aclose", None)
    if close is not None and not getattr(it, "ag_running", False):
        await close()
