"""Producers that work in this process (``num_workers=0``): no workers to start or reap."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from ._codec import tensors_nbytes
from ._loads import LoadOptions, LoadStage, SkipLog, SkippedLoad
from ._pipeline import BatchOptions, ShardPass, collate_with, sync_batches
from ._position import (
    PASS_START,
    BlockStart,
    Mark,
    Shard,
    ShardPosition,
    ShardTracker,
    StreamPosition,
)
from ._producers import INSTANCE_CHUNK, Plan, Plans
from ._session import Activity, Delivered, PassDone, Step
from ._sources import Kind, fetch, is_async
from ._stats import NO_ARENA, ArenaStats, WorkerStats

T = TypeVar("T")


class _InProcess:
    """No workers: nothing to start, watch or reap; blocking work runs in one thread.

    One dedicated thread, not asyncio's default executor: that one alternates between its
    threads, each with its own malloc arena (a freed 9.6 MB batch goes back to the kernel
    and faults in again: 250-1100 page faults a batch) and its own OpenMP team (issue 9;
    image batches 0.57x -> 1.02x torch's num_workers=0).
    """

    def __init__(self, *, timed: bool) -> None:
        self.activity = Activity()
        # Signs of life matter only to a timeout: without one, no clock read per instance.
        self.timed = timed
        self.touch: Callable[[], None] | None = self.activity.touch if timed else None
        self.private = False  # the loop is the sync adapter's own: blocking it is fine
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    async def start(self) -> None:
        pass

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="aioloader-local")
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def stop_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False)  # a call still running ends on its own

    def last_activity(self) -> float:
        return self.activity()

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        return (), NO_ARENA

    def attach(self, private: bool) -> None:
        self.private = private

    def detach(self) -> None:
        self.private = False

    async def aclose(self, grace: float) -> None:
        self.close(grace)

    def close(self, grace: float) -> None:
        self.stop_thread()


class LocalIndex(_InProcess):
    """Index batches of a map-style source, fetched and collated in this process.

    On the sync adapter's private loop the work runs inline (as torch's ``num_workers=0``
    does); on a user's loop it runs in a thread, so the loop never blocks.
    """

    def __init__(self, dataset: Any, plan: Plan, first_pass: int,
                 collate_fn: Callable[[list[Any]], Any] | None, *, timed: bool,
                 skip: int = 0, loads: LoadOptions | None = None,
                 skips: SkipLog | None = None, ahead: int = 4) -> None:
        super().__init__(timed=timed)
        self._dataset = dataset
        self._collate = collate_with(collate_fn)
        self._plans = Plans(plan, first_pass, skip=skip)
        self._loads = loads
        self._skips = skips if skips is not None else SkipLog()
        self._ahead = ahead
        self._stage: LoadStage | None = None
        self._fetches: collections.deque[asyncio.Future[list[Any]] | PassDone] = \
            collections.deque()

    def _fetch(self, indices: list[int]) -> Any:
        return self._collate(fetch(self._dataset, indices, self.touch))

    async def next(self) -> Step:
        if self._loads is not None:
            return await self._next_loaded(self._loads)
        indices = await self._plans.next()
        if isinstance(indices, PassDone):
            return indices
        if self.private and not self.timed:  # a timeout needs the loop free to fire
            batch = self._fetch(indices)
        else:
            batch = await self.offload(self._fetch, indices)
        return Delivered(batch, nbytes=tensors_nbytes(batch))

    async def _next_loaded(self, loads: LoadOptions) -> Step:
        """With a load stage: the loads of the next ``ahead`` batches overlap on this loop
        (the stage's gate bounds them); batches come in the plan's order."""
        while True:
            if self._stage is None:  # one stage a pass: its sessions live on this loop
                self._stage = await LoadStage(self._dataset, loads, worker=None,
                                              report=self._skips.add).__aenter__()
            stage = self._stage
            while len(self._fetches) < self._ahead and not (
                    self._fetches and isinstance(self._fetches[-1], PassDone)):
                step = await self._plans.next()
                self._fetches.append(step if isinstance(step, PassDone) else
                                     asyncio.ensure_future(stage.fetch(self._dataset, step)))
            head = self._fetches.popleft()
            if isinstance(head, PassDone):
                await self._end_stage()
                return head
            group = await head
            if self.touch is not None:
                self.touch()
            if not group:
                continue  # every key of this batch was skipped (and reported)
            if self.private and not self.timed:
                batch = self._collate(group)
            else:
                batch = await self.offload(self._collate, group)
            return Delivered(batch, nbytes=tensors_nbytes(batch))

    async def _end_stage(self) -> None:
        fetches = [f for f in self._fetches if not isinstance(f, PassDone)]
        self._fetches.clear()
        for f in fetches:
            f.cancel()
        await asyncio.gather(*fetches, return_exceptions=True)
        stage, self._stage = self._stage, None
        if stage is not None:
            await stage.__aexit__(None, None, None)

    async def aclose(self, grace: float) -> None:
        await self._end_stage()
        self.close(grace)

    def close(self, grace: float) -> None:
        for f in self._fetches:  # no loop to wait on here: cancelling is what is left
            if not isinstance(f, PassDone):
                f.cancel()
        self._fetches.clear()
        stage, self._stage = self._stage, None
        if stage is not None:
            stage.abandon()
        self.stop_thread()

    def behind(self) -> str:
        return "the dataset in this process (num_workers=0)"


_END = object()


class LocalStream(_InProcess):
    """Passes over a reader or IterableDataset, batched and collated in this process."""

    def __init__(self, source: Any, kind: Kind, data_path: Any, options: BatchOptions,
                 collate_fn: Callable[[list[Any]], Any] | None,
                 seed_for: Callable[[int], int], start: ShardPosition, rank: int,
                 world_size: int, *, timed: bool, produced: int = 0,
                 loads: LoadOptions | None = None, skips: SkipLog | None = None) -> None:
        super().__init__(timed=timed)
        self._open: Callable[[BlockStart], Shard] = lambda begin: Shard(
            source, kind, data_path, 0, 1, rank, world_size, begin, keys=loads is not None)
        self._stage: Callable[[], LoadStage] | None = None
        if loads is not None:
            log = skips if skips is not None else SkipLog()
            self._stage = lambda: LoadStage(source, loads, worker=None, report=log.add)
        self._options = options
        self._collate = collate_with(collate_fn)
        self._seed_for = seed_for
        self._shard = ShardTracker(start)
        self._start: ShardPosition | None = start  # the first pass's, once
        self._produced = produced
        self._pass: _LocalPass | None = None

    def position(self) -> StreamPosition:
        return StreamPosition((self._shard.position,), 0, (0,), self._produced)

    async def next(self) -> Step:
        if self._pass is None:
            pass_no = self._shard.position.pass_no
            start, self._start = self._start, None
            shard = self._open(start.start if start is not None else PASS_START)
            batcher = ShardPass(shard, self._options, self._seed_for(pass_no), start)
            self._pass = _LocalPass(shard.stream, batcher, self._collate, self.touch,
                                    self.offload, self._stage)
        got = await self._pass.next()
        if got is not _END:
            value, mark = got
            self._shard.delivered(mark)
            self._produced += 1
            return Delivered(value, mark=mark, nbytes=tensors_nbytes(value))
        done = PassDone(self._produced == 0)
        self._pass = None
        self._shard.ended()
        self._produced = 0
        return done

    def behind(self) -> str:
        return "the reader in this process (num_workers=0)"

    async def aclose(self, grace: float) -> None:
        current, self._pass = self._pass, None
        if current is not None:
            await current.aclose()
        self.stop_thread()

    def close(self, grace: float) -> None:
        current, self._pass = self._pass, None
        if current is not None:
            current.close()
        self.stop_thread()


class _LocalPass:
    """One pass of a :class:`LocalStream`: plain state, no generator of ours.

    A session outlives the event loop of one epoch, and a loop closes the async generators
    first iterated on it when it shuts down; so the reader's own async iterator is started
    without the loop's hooks (see :func:`_anext_unhooked`) and closed by the session.
    """

    def __init__(self, stream: Any, batcher: ShardPass, collate: Callable[[list[Any]], Any],
                 touch: Callable[[], None] | None,
                 offload: Callable[..., Awaitable[Any]],
                 stage: Callable[[], LoadStage] | None = None) -> None:
        self.collate = collate
        self.touch = touch
        self.offload = offload
        self.started = False
        self.async_it: Any = None
        self.sync_it: Iterator[Any] | None = None
        self.groups: collections.deque[tuple[list[Any], Mark]] = collections.deque()
        if stage is not None:  # keys, loaded on this loop: the async path
            self.async_it = Loaded(stream, stage, offload)
            self.batcher = batcher
            self.exhausted = False
        elif is_async(stream):
            self.async_it = stream.__aiter__()
            self.batcher = batcher
            self.exhausted = False
        else:
            self.sync_it = ((collate(g), mark) for g, mark in
                            sync_batches(_touching(stream, touch), batcher))

    async def next(self) -> Any:
        """The next (collated batch, mark), or _END."""
        if self.sync_it is not None:
            return await self.offload(next, self.sync_it, _END)
        while not self.groups and not self.exhausted:
            try:
                if self.started:
                    instance = await self.async_it.__anext__()
                else:
                    self.started = True
                    instance = await _anext_unhooked(self.async_it)
            except StopAsyncIteration:
                self.groups.extend(self.batcher.finish())
                self.exhausted = True
            else:
                if self.touch is not None:
                    self.touch()
                self.groups.extend(self.batcher.feed(instance))
        if not self.groups:
            return _END
        group, mark = self.groups.popleft()
        return self.collate(group), mark

    async def aclose(self) -> None:
        self.close()
        await _aclose(self.async_it)

    def close(self) -> None:
        if isinstance(self.async_it, Loaded):
            self.async_it.abandon()
        it, self.sync_it = self.sync_it, None
        if it is not None:
            with contextlib.suppress(ValueError):  # still running in its thread: it ends
                it.close()  # type: ignore[attr-defined]


class Keys:
    """A source's keys as an async iterator for a load stage; a sync source's are taken in
    chunks off the loop (listing may block). Not an async generator: no loop's hooks hold
    it, the pass closes it (see :class:`_LocalPass`)."""

    def __init__(self, stream: Any, offload: Callable[..., Awaitable[Any]]) -> None:
        self._offload = offload
        self._async: Any = None
        self._sync: Iterator[Any] | None = None
        if is_async(stream):
            self._async = stream.__aiter__()
            self._first = True
        else:
            self._sync = iter(stream)
        self._chunk: collections.deque[Any] = collections.deque()
        self._done = False

    def __aiter__(self) -> Keys:
        return self

    async def __anext__(self) -> Any:
        if self._async is not None:
            if self._first:
                self._first = False
                return await _anext_unhooked(self._async)
            return await self._async.__anext__()
        if not self._chunk and not self._done:
            assert self._sync is not None
            got = await self._offload(lambda: list(itertools.islice(self._sync, INSTANCE_CHUNK)))
            self._done = len(got) < INSTANCE_CHUNK
            self._chunk.extend(got)
        if not self._chunk:
            raise StopAsyncIteration
        return self._chunk.popleft()

    async def aclose(self) -> None:
        await _aclose(self._async)


class Loaded:
    """A source's keys through a load stage on this loop: instances (and SkippedLoad
    markers) as an async iterator. The stage opens at the first item and closes with
    :meth:`aclose`; not an async generator, so no loop's hooks hold it."""

    def __init__(self, stream: Any, stage: Callable[[], LoadStage],
                 offload: Callable[..., Awaitable[Any]]) -> None:
        self._keys = Keys(stream, offload)
        self._make = stage
        self._stage: LoadStage | None = None
        self._items: Any = None

    def __aiter__(self) -> Loaded:
        return self

    async def __anext__(self) -> Any:
        if self._items is None:
            self._stage = await self._make().__aenter__()
            self._items = self._stage.stream(self._keys)
            return await _anext_unhooked(self._items)
        return await self._items.__anext__()

    async def aclose(self) -> None:
        await _aclose(self._items)
        await self._keys.aclose()
        stage, self._stage = self._stage, None
        if stage is not None:
            await stage.__aexit__(None, None, None)

    def abandon(self) -> None:
        """No loop to wait on (a synchronous close): cancel the loads in flight."""
        if self._stage is not None:
            self._stage.abandon()


def _touching(stream: Any, touch: Callable[[], None] | None) -> Iterator[Any]:
    """``stream``, with ``touch()`` after every item (``None``: the stream as it is)."""
    if touch is None:
        return iter(stream)
    return _each_touched(stream, touch)


def _each_touched(stream: Any, touch: Callable[[], None]) -> Iterator[Any]:
    for item in stream:
        touch()
        yield item


async def _aclose(it: Any) -> None:
    """Close an async iterator, unless a consumer is inside it right now: the close has
    cancelled that consumer, and the cancellation unwinding through it ends it."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None and not getattr(it, "ag_running", False):
        await aclose()


def _anext_unhooked(it: Any) -> Any:
    """``it.__anext__()``, with an async generator's first step not tied to this loop.

    An async generator consults the loop's hooks once, at its first step: started this
    way, no loop closes it at shutdown, and the session closes it itself.
    """
    hooks = sys.get_asyncgen_hooks()
    sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
    try:
        return it.__anext__()
    finally:
        sys.set_asyncgen_hooks(*hooks)


class LocalInstances(_InProcess):
    """One pass of instances read in this process, in chunks (a sync reader in a thread)."""

    def __init__(self, source: Any, kind: Kind, data_path: Any, rank: int,
                 world_size: int, *, timed: bool, loads: LoadOptions | None = None,
                 skips: SkipLog | None = None) -> None:
        super().__init__(timed=timed)
        self._stream = Shard(source, kind, data_path, 0, 1, rank, world_size,
                             keys=loads is not None).stream
        self._sync: Iterator[Any] | None = None
        self._async: Any = None
        self._done = False
        if loads is not None:
            log = skips if skips is not None else SkipLog()
            self._async = Loaded(self._stream, lambda: LoadStage(
                source, loads, worker=None, report=log.add), self.offload)

    def _chunk(self) -> list[Any]:
        assert self._sync is not None
        return list(itertools.islice(self._sync, INSTANCE_CHUNK))

    async def next(self) -> Step:
        if self._done:
            return PassDone(False)
        if self._async is not None or is_async(self._stream):
            if self._async is None:
                self._async = self._stream.__aiter__()  # type: ignore[union-attr]
            chunk = []
            async for item in self._async:
                if self.touch is not None:
                    self.touch()
                if not isinstance(item, SkippedLoad):  # a key whose load was skipped
                    chunk.append(item)
                if len(chunk) >= INSTANCE_CHUNK:
                    break
            else:
                self._done = True
        else:
            if self._sync is None:
                self._sync = _touching(self._stream, self.touch)
            chunk = await self.offload(self._chunk)
            self._done = len(chunk) < INSTANCE_CHUNK
        return Delivered(chunk)

    def behind(self) -> str:
        return "the reader in this process (num_workers=0)"

    async def aclose(self, grace: float) -> None:
        await _aclose(self._async)
        self.close(grace)

    def close(self, grace: float) -> None:
        if isinstance(self._async, Loaded):
            self._async.abandon()
        it, self._sync = self._sync, None
        close = getattr(it, "close", None)  # a reader's own iterator may have none
        if close is not None:
            with contextlib.suppress(ValueError):  # still running in its thread: it ends
                close()
        self.stop_thread()
