"""The pipeline, written once: source → loads → batcher → collate, in a worker or in this process.

```
 Shard (sharded, resumed) ─► keys ─► LoadStage.stream ─► instances ─┬─► ShardPass ─► Batch, Boundary
   (no load stage: the shard's instances themselves)                └─► chunks (a cache fills)
 index batches ─► fetch() or LoadStage.fetch() (InOrder: overlapped, in order) ─► collate
```

Each is a plain iterable (a sync source without a load stage) or an async one, started
without the loop's async-generator hooks (:func:`unhooked`) and closed by whoever iterates
it: an in-process producer outlives the loop of one epoch, which would close at its
shutdown the generators first iterated on it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .._errors import CollateKeyError
from ..plans._batcher import Batcher, Group
from ..plans._position import PASS_START, BlockStart, Frontier, Mark, ShardPosition
from ..plans._samplers import BatchSampler
from ..plans._shard import Raised, Shard
from ..plans._sources import Kind, Unhooked, aclose, as_async, fetch, unhooked
from ._collate import PadCollate, Unbatched, default_collate
from ._loads import LoadOptions, LoadStage, Report, SkippedLoad

T = TypeVar("T")
R = TypeVar("R")
INSTANCE_CHUNK = 64  # instances per chunk when instances themselves are handed on (a cache)
Offload = Callable[..., Awaitable[Any]]  # runs a blocking call off the loop: offload(fn, *args)
Touch = Callable[[], None]  # a sign of life, after every instance (a timeout measures silence)


@dataclass(frozen=True)
class BatchOptions:
    """How instances are grouped: the loader's batching options, as data."""

    batch_size: int | None
    drop_last: bool
    shuffle: bool
    sampler: BatchSampler | None
    chunk_size: int | None  # max_instances_in_memory; None = the whole pass at once


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch's instances, due to be collated, and where it lies in its pass; ``error``:
    what the source raised while it was filled, which is then the batch."""

    items: list[Any]
    mark: Mark
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class Boundary:
    """The pass stands between two blocks: a successor could begin at ``start``."""

    start: BlockStart


Step = Batch | Boundary


class ShardPass:
    """One pass over one shard: instances in, batches out, each with its :data:`Mark`. Each
    block's start (``shard.mark``) goes with its first batch, so the consumer always knows
    where to resume; resuming, batches delivered already are dropped before any collate."""

    def __init__(self, shard: Shard, options: BatchOptions, seed: int,
                 start: ShardPosition | None = None) -> None:
        begin = start.start if start is not None else PASS_START
        self.shard = shard
        self.batcher = Batcher(batch_size=options.batch_size, drop_last=options.drop_last,
                               shuffle=options.shuffle, sampler=options.sampler,
                               chunk_size=options.chunk_size, seed=seed,
                               first_block=begin.block)
        self.taken = 0
        self.starts: dict[int, BlockStart] = {begin.block: begin}
        self._skip_block = begin.block
        self._skip = start.batches if start is not None else 0
        self._loose: list[int] = []  # numbered keys skipped on error, for the next mark
        self._gap = -1  # the last block with a key skipped on error (its batches skip it)

    def take(self, instance: Any) -> list[Step]:
        """Take one instance (a skipped key's marker; a numbered stream's ``(number, instance)``):
        the batches it completes, then a :class:`Boundary` where a block closed (or begins)."""
        self.taken += 1
        # A key skipped on error counts for the position, and has nothing to batch.
        item = instance[1] if self.shard.numbered else instance
        error: Exception | None = None  # the source's, where the batch being filled failed
        if isinstance(item, SkippedLoad):
            groups = []
            if self.shard.numbered:
                self._loose.append(instance[0])
            self._gap = self.batcher.block
        elif isinstance(item, Raised):
            if not self.batcher.streams:  # a block cut whole has no batch of its own to fail
                raise item.error
            groups = [self.batcher.fail()]
            error = item.error
        else:
            groups = self.batcher.feed(instance)
        steps: list[Step] = self._marked(groups, error) if groups else []
        if self.batcher.filled == 0:  # a block closed (or has not begun): the next starts here
            block = self.batcher.block
            self.starts[block] = self.shard.mark(block, self.taken)
            steps.append(Boundary(self.starts[block]))
        return steps

    def finish(self) -> list[Step]:
        """The pass's last batches."""
        return self._marked(self.batcher.finish())

    def _marked(self, groups: list[Group], error: Exception | None = None) -> list[Step]:
        """``groups`` as batches with their marks; ``error``: the group failed with it."""
        out: list[Step] = []
        for block, index, items, size in groups:
            if block == self._skip_block and index < self._skip:
                continue  # delivered before the resume
            start = self.starts.pop(block, None)
            mark = [block, index, start.to_wire() if start is not None else None, size]
            if self.shard.numbered:  # the keys it holds (and those skipped since the last)
                mark.append([n for n, _ in items] + self._loose)
                items, self._loose = [x for _, x in items], []
            elif block == self._gap:  # its instances are not the block's first keys in a row
                mark += [None, True]
            out.append(Batch(items, mark, error))
        return out


@dataclass(frozen=True)
class Pipeline:
    """What one shard reads and how it becomes batches: a worker's (``worker`` of
    ``num_workers``) or this process's (the defaults)."""

    source: Any
    kind: Kind
    data_path: Any
    options: BatchOptions | None  # None: not batched here (index batches, instances)
    collate_fn: Callable[[list[Any]], Any] | None
    loads: LoadOptions | None = None  # the source yields keys; a load stage loads them
    worker: int = 0
    num_workers: int = 1
    rank: int = 0
    world_size: int = 1

    def collate(self, items: list[Any], indices: list[Any] | None = None) -> Any:
        """``items`` collated. ``indices``: the dataset indices they were fetched at, which a
        :class:`CollateKeyError` of our collate then names beside the sample's place."""
        try:
            return (self.collate_fn or default_collate)(items)
        except CollateKeyError as exc:
            ours = self.collate_fn in (None, default_collate) or isinstance(self.collate_fn,
                                                                           PadCollate)
            if not ours or indices is None or len(indices) != len(items) or exc.sample is not None:
                raise  # a collate of the user's may have reordered the samples
            raise exc.with_sample(indices[exc.position]).with_traceback(
                exc.__traceback__) from None

    def stage(self, worker: int | None, report: Report) -> LoadStage | None:
        """The load stage, to enter (None: the source yields instances)."""
        if self.loads is None:
            return None
        return LoadStage(self.source, self.loads, worker=worker, report=report)

    def fetch(self, indices: list[int], touch: Touch | None = None) -> list[Any]:
        """A map-style batch's instances (with a load stage: ``LoadStage.fetch``)."""
        return fetch(self.source, indices, touch,
                     bulk=not isinstance(self.collate_fn, Unbatched))

    def shard(self, start: BlockStart = PASS_START, frontier: Frontier | None = None,
              numbered: tuple[int, ...] | None = None, *, batched: bool = False) -> Shard:
        """This pass's shard from ``start``; ``numbered``: keys go as ``(number, key)``, those
        delivered left out. ``batched``: a torch IterableDataset's error is then one batch's
        and its iterator goes on (torch's worker loop; a cache's instances have no batch)."""
        skip = None
        if frontier is not None:
            assert self.options is not None, "only a stream of batches is resumed on a new shape"
            skip = frontier.delivered(self.options)
        return Shard(self.source, self.kind, self.data_path, self.worker, self.num_workers,
                     self.rank, self.world_size, start, keys=self.loads is not None,
                     delivered=skip, numbered=numbered,
                     errors_go_on=batched and self.kind is Kind.ITERABLE and self.loads is None)

    def numbers_keys(self) -> bool:
        """Whether a stream's keys are numbered, for positions, as loads finish out of order
        (``ordered=False``); not under a BatchSampler (no position: ``state_dict`` refuses)."""
        return (self.loads is not None and not self.loads.ordered and self.options is not None
                and self.options.sampler is None)

    def instances(self, shard: Shard, stage: LoadStage | None, offload: Offload | None = None,
                  *, ordered: bool | None = None) -> Iterable[Any] | Unhooked[Any]:
        """The shard's instances: a plain iterable for a sync source without a load stage,
        else an async iterator (a load stage's has :class:`SkippedLoad` markers, which
        positions count). A sync source's keys are listed through ``offload`` (None: in place)."""
        stream = shard.stream
        if isinstance(stream, AsyncIterable):
            keys: Unhooked[Any] = unhooked(stream)
        elif stage is None:
            return stream
        else:
            keys = unhooked(_listed(stream, offload))
        if stage is None:
            return keys
        return unhooked(stage.stream(keys, ordered=ordered, tagged=shard.numbered))

    def batches(self, start: ShardPosition, seed: int, stage: LoadStage | None, *,
                touch: Touch | None = None,
                offload: Offload | None = None) -> Iterator[Step] | Unhooked[Step]:
        """One pass's batches (and block boundaries), from ``start`` on; batches are seeded
        from ``seed``, the pass's."""
        assert self.options is not None
        numbered = (start.keys or (0,)) if self.numbers_keys() else None
        shard = self.shard(start.start, start.frontier, numbered, batched=True)
        return _cut(self.instances(shard, stage, offload),
                    ShardPass(shard, self.options, seed, start), touch)

    def chunks(self, start: BlockStart, stage: LoadStage | None, *,
               touch: Touch | None = None,
               offload: Offload | None = None) -> Iterator[list[Any]] | Unhooked[list[Any]]:
        """One pass's instances (and skipped keys' markers), in lists of :data:`INSTANCE_CHUNK`,
        in the keys' order (a cache's order must not depend on which load finished first)."""
        return _cut(self.instances(self.shard(start), stage, offload, ordered=True),
                    _Chunks(), touch)


class _Chunks:
    """Instances in lists of :data:`INSTANCE_CHUNK`, cut as :class:`ShardPass` cuts batches."""

    def __init__(self) -> None:
        self.chunk: list[Any] = []

    def take(self, instance: Any) -> list[list[Any]]:
        self.chunk.append(instance)
        if len(self.chunk) < INSTANCE_CHUNK:
            return []
        chunk, self.chunk = self.chunk, []
        return [chunk]

    def finish(self) -> list[list[Any]]:
        return [self.chunk] if self.chunk else []


class _Cut(Protocol[T]):
    def take(self, instance: Any) -> list[T]: ...
    def finish(self) -> list[T]: ...


def _cut(instances: Iterable[Any] | Unhooked[Any], cut: _Cut[T],
         touch: Touch | None) -> Iterator[T] | Unhooked[T]:
    """What ``cut`` makes of ``instances``, with a ``touch`` after each instance."""
    if isinstance(instances, Unhooked):
        return unhooked(_async_cut(instances, cut, touch))
    return _sync_cut(instances, cut, touch)


def _sync_cut(instances: Iterable[Any], cut: _Cut[T], touch: Touch | None) -> Iterator[T]:
    for instance in instances:
        if touch is not None:
            touch()
        yield from cut.take(instance)
    yield from cut.finish()


async def _async_cut(instances: AsyncIterator[Any], cut: _Cut[T],
                     touch: Touch | None) -> AsyncIterator[T]:
    try:
        async for instance in instances:
            if touch is not None:
                touch()
            for step in cut.take(instance):
                yield step
        for step in cut.finish():
            yield step
    finally:
        await aclose(instances)


async def _listed(stream: Iterable[Any], offload: Offload | None) -> AsyncIterator[Any]:
    """A sync source's keys, for a load stage: taken in chunks through ``offload`` (listing
    may block), or one by one in place (``None``: a worker's loop may block)."""
    it = iter(stream)
    if offload is None:
        for key in it:
            yield key
        return
    while True:
        chunk = await offload(_take, it, INSTANCE_CHUNK)
        for key in chunk:
            yield key
        if len(chunk) < INSTANCE_CHUNK:
            return


def _take(it: Iterator[T], n: int) -> list[T]:
    return list(itertools.islice(it, n))


def each(steps: Iterable[T] | Unhooked[T]) -> Unhooked[T]:
    """``steps`` as an async iterator: a plain iterable is pulled in place (in a worker,
    where blocking the loop is fine)."""
    if isinstance(steps, Unhooked):
        return steps
    return unhooked(as_async(steps))


class InOrder(Generic[R, T]):
    """``start(request)`` for each request as it arrives, results handed on in the requests'
    order; ``ahead``: at most so many started and not handed on (None: the requester bounds
    them). Not an async generator (module docstring); :meth:`aclose` cancels what is in flight.
    """

    def __init__(self, requests: AsyncIterable[R], start: Callable[[R], Awaitable[T]],
                 ahead: int | None = None) -> None:
        self._requests = unhooked(requests)
        self._start = start
        self._room = asyncio.Semaphore(ahead) if ahead is not None else None
        self._started: collections.deque[tuple[R, asyncio.Future[T]]] = collections.deque()
        self._more = asyncio.Event()  # a request started, or the requests ended
        self._intake: asyncio.Future[None] | None = None

    def __aiter__(self) -> InOrder[R, T]:
        return self

    async def __anext__(self) -> tuple[R, T]:
        if self._intake is None:
            self._intake = asyncio.ensure_future(self._take())
        while not self._started:
            if self._intake.done():
                self._intake.result()  # the intake failed: raise its error
                raise StopAsyncIteration
            self._more.clear()
            await self._more.wait()
        request, working = self._started[0]
        result = await working
        self._started.popleft()
        if self._room is not None:
            self._room.release()
        return request, result

    async def _take(self) -> None:
        try:
            while True:
                if self._room is not None:
                    await self._room.acquire()
                try:
                    request = await self._requests.__anext__()
                except StopAsyncIteration:
                    return
                self._started.append((request, asyncio.ensure_future(self._start(request))))
                self._more.set()
        finally:
            self._more.set()

    def abandon(self) -> list[asyncio.Future[Any]]:
        """Cancel what is in flight (a synchronous close: no loop to wait on); what was."""
        flight: list[asyncio.Future[Any]] = [f for _, f in self._started]
        if self._intake is not None:
            flight.append(self._intake)
        self._started.clear()
        self._intake = None
        for f in flight:
            f.cancel()
        return flight

    async def aclose(self) -> None:
        await asyncio.gather(*self.abandon(), return_exceptions=True)
        await aclose(self._requests)
