"""Sessions: what produces an epoch's batches, in this process or through workers.

A session outlives one epoch, so that a stream can continue across epochs
(``batches_per_epoch``) and the next epoch is prefetched while this one is consumed. It
answers ``next()`` with a :class:`Delivered` batch or a :class:`PassDone` at the end of
one pass over the data; the loader decides what an epoch is.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import pickle
import sys
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from . import _wire as wire
from ._pipeline import BatchOptions, PassBatcher, collate_with, sync_batches
from ._sources import Kind, fetch, is_async, open_shard
from ._supervisor import GRACE, Supervisor


@dataclass(frozen=True, slots=True)
class Delivered:
    value: Any


@dataclass(frozen=True, slots=True)
class PassDone:
    empty: bool  # the whole pass produced no batch


Step = Delivered | PassDone


class Session(Protocol):
    async def next(self) -> Step: ...
    def behind(self) -> str: ...
    def attach(self) -> None: ...
    def detach(self) -> None: ...
    async def aclose(self, grace: float = GRACE) -> None: ...
    def close(self) -> None: ...
    def kill(self) -> None: ...


class CachedInstances(Sequence[Any]):
    """The instances of a cached pass; pickled by value for spawned workers.

    torch's multiprocessing pickler would move every tensor into its own shared-memory
    segment (one fd each); one plain pickle of the whole list is far cheaper.
    """

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_cached, (pickle.dumps(self.items, protocol=pickle.HIGHEST_PROTOCOL),))


def _unpickle_cached(data: bytes) -> CachedInstances:
    return CachedInstances(pickle.loads(data))


# ---------------------------------------------------------------------- in this process

_END = object()


def _next_or_end(it: Iterator[Any]) -> Any:
    return next(it, _END)


class _LocalPass:
    """The state of one pass of a :class:`LocalStream`; plain objects, no generators of ours.

    A session outlives the event loop of one epoch (the sync adapter runs a loop per
    epoch), and a loop closes the async generators first iterated on it when it shuts down.
    So the pass is kept as plain state, and the reader's own async iterator is started
    without the loop's hooks (see :func:`_anext_unhooked`).
    """

    def __init__(self, stream: Any, batcher: PassBatcher, collate: Callable[[list[Any]], Any]):
        self.collate = collate
        self.produced = 0
        self.started = False
        self.async_it: Any = None
        self.sync_it: Iterator[Any] | None = None
        if is_async(stream):
            self.async_it = stream.__aiter__()
            self.batcher = batcher
            self.groups: collections.deque[list[Any]] = collections.deque()
            self.exhausted = False
        else:
            self.sync_it = (collate(g) for g in sync_batches(stream, batcher))

    async def next(self) -> Any:
        """The next collated batch, or _END."""
        if self.sync_it is not None:
            return await asyncio.to_thread(_next_or_end, self.sync_it)
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
                self.groups.extend(self.batcher.feed(instance))
        if not self.groups:
            return _END
        return self.collate(self.groups.popleft())

    async def aclose(self) -> None:
        self.close()
        aclose = getattr(self.async_it, "aclose", None)
        if aclose is not None:
            await aclose()

    def close(self) -> None:
        it, self.sync_it = self.sync_it, None
        if it is not None:
            try:
                it.close()  # type: ignore[attr-defined]
            except ValueError:  # still running in its thread (a timeout): it ends on its own
                pass


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


class _InProcess:
    """A session without workers: nothing to watch on the event loop."""

    def attach(self) -> None:
        pass

    def detach(self) -> None:
        pass


class LocalStream(_InProcess):
    """Passes over a reader or IterableDataset, batched and collated in this process."""

    def __init__(self, source: Any, kind: Kind, data_path: Any, options: BatchOptions,
                 collate_fn: Callable[[list[Any]], Any] | None,
                 seed_for: Callable[[int], int], first_pass: int, rank: int = 0,
                 world_size: int = 1) -> None:
        self._source, self._kind, self._data_path = source, kind, data_path
        self._rank, self._world_size = rank, world_size
        self._options = options
        self._collate = collate_with(collate_fn)
        self._seed_for = seed_for
        self._pass_no = first_pass
        self._pass: _LocalPass | None = None

    async def next(self) -> Step:
        if self._pass is None:
            batcher = PassBatcher(self._options, self._seed_for(self._pass_no))
            stream = open_shard(self._source, self._kind, self._data_path, 0, 1, self._rank,
                                self._world_size)
            self._pass = _LocalPass(stream, batcher, self._collate)
        value = await self._pass.next()
        if value is not _END:
            self._pass.produced += 1
            return Delivered(value)
        done = PassDone(self._pass.produced == 0)
        self._pass = None
        self._pass_no += 1
        return done

    def behind(self) -> str:
        return "the reader in this process (num_workers=0)"

    async def aclose(self, grace: float = GRACE) -> None:
        current, self._pass = self._pass, None
        if current is not None:
            await current.aclose()

    def close(self) -> None:
        self.kill()

    def kill(self) -> None:
        current, self._pass = self._pass, None
        if current is not None:
            current.close()


class LocalIndex(_InProcess):
    """Index batches of a map-style source, fetched and collated off the event loop."""

    def __init__(self, dataset: Any, passes: Iterator[list[list[int]]],
                 collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self._dataset = dataset
        self._collate = collate_with(collate_fn)
        self._steps = _steps(passes)

    def _fetch(self, indices: list[int]) -> Any:
        return self._collate(fetch(self._dataset, indices))

    async def next(self) -> Step:
        indices = next(self._steps)
        if isinstance(indices, PassDone):
            return indices
        return Delivered(await asyncio.to_thread(self._fetch, indices))

    def behind(self) -> str:
        return "the dataset in this process (num_workers=0)"

    async def aclose(self, grace: float = GRACE) -> None:
        pass

    def close(self) -> None:
        pass

    def kill(self) -> None:
        pass


def _steps(passes: Iterator[list[list[int]]]) -> Iterator[list[int] | PassDone]:
    for batches in passes:
        yield from batches
        yield PassDone(not batches)


async def local_instances(source: Any, kind: Kind, data_path: Any, rank: int = 0,
                          world_size: int = 1) -> AsyncGenerator[Any, None]:
    """The instances of one pass, read in this process (a sync reader in a thread)."""
    stream = open_shard(source, kind, data_path, 0, 1, rank, world_size)
    if is_async(stream):
        async for item in stream:  # type: ignore[union-attr]
            yield item
        return
    it = iter(stream)  # type: ignore[arg-type]
    chunk = 64
    try:
        while True:
            items = await asyncio.to_thread(lambda: list(itertools.islice(it, chunk)))
            for item in items:
                yield item
            if len(items) < chunk:
                return
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):
                close()


# ---------------------------------------------------------------------- through workers

class _OnWorkers:
    """The lifetime of a session whose batches come from a supervisor's workers."""

    sup: Supervisor

    def attach(self) -> None:
        self.sup.attach()

    def detach(self) -> None:
        self.sup.detach()

    async def aclose(self, grace: float = GRACE) -> None:
        await self.sup.aclose(grace)

    def close(self) -> None:
        self.sup.close()

    def kill(self) -> None:
        self.sup.kill()


class WorkerStream(_OnWorkers):
    """Each worker streams passes over its shard; batches are taken round-robin."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.n = sup.num_workers
        self._rr = 0
        self._pending = set(range(self.n))
        self._produced = 0
        self._waiting: int | None = None

    def _next_worker(self) -> int:
        for k in range(self.n):
            w = (self._rr + k) % self.n
            if w in self._pending:
                return w
        raise AssertionError("no worker pending")

    async def next(self) -> Step:
        while True:
            if not self._pending:
                done = PassDone(self._produced == 0)
                self._pending = set(range(self.n))
                self._produced = 0
                return done
            w = self._next_worker()
            self._waiting = w
            msg = await self.sup.receive(w)
            self._waiting = None
            if isinstance(msg, wire.Batch):
                self._rr = w + 1
                self._produced += 1
                return Delivered(await self.sup.take(w, msg))
            if isinstance(msg, wire.PassEnd):
                self.sup.release(w, msg.slot)
                self._pending.discard(w)
            else:
                raise AssertionError(f"unexpected message {msg!r}")

    def behind(self) -> str:
        ids = [self._waiting] if self._waiting is not None else sorted(self._pending)
        return self.sup.describe(ids)


@dataclass(frozen=True, slots=True)
class _InFlight:
    seq: int
    worker: int


class WorkerIndex(_OnWorkers):
    """The main process plans index batches; worker ``seq % n`` fetches batch ``seq``.

    Batches come back in the plan's order whatever the number of workers. At most
    ``slots`` tasks are outstanding per worker, which is also how many slots it has.
    """

    def __init__(self, sup: Supervisor, passes: Iterator[list[list[int]]], slots: int) -> None:
        self.sup = sup
        self.n = sup.num_workers
        self._steps = _steps(passes)
        self._window = self.n * slots
        self._queue: collections.deque[_InFlight | PassDone] = collections.deque()
        self._seq = 0

    def _fill(self) -> None:
        while len(self._queue) < self._window:
            step = next(self._steps)
            if isinstance(step, PassDone):
                self._queue.append(step)
                continue
            w = self._seq % self.n
            self.sup.send(w, wire.Task(self._seq, step))
            self._queue.append(_InFlight(self._seq, w))
            self._seq += 1

    async def next(self) -> Step:
        self._fill()
        head = self._queue[0]
        if isinstance(head, PassDone):
            self._queue.popleft()
            return head
        msg = await self.sup.receive(head.worker)
        self._queue.popleft()
        if not isinstance(msg, wire.Batch) or msg.seq != head.seq:
            raise AssertionError(f"expected batch {head.seq} from worker {head.worker}, "
                                 f"got {msg!r}")
        return Delivered(await self.sup.take(head.worker, msg))

    def behind(self) -> str:
        head = self._queue[0] if self._queue else None
        ids = [head.worker] if isinstance(head, _InFlight) else list(range(self.n))
        return self.sup.describe(ids)


class WorkerInstances:
    """One pass of instances from workers started with the "instances" plan.

    Instances are interleaved one by one round-robin, which restores the reader's own order
    when the loader shards (worker k holds positions k, k + n, ...).
    """

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self._bufs: list[collections.deque[Any]] = [collections.deque()
                                                    for _ in range(sup.num_workers)]
        self._live = list(range(sup.num_workers))
        self._k = 0
        self._waiting: int | None = None

    def __aiter__(self) -> WorkerInstances:
        return self

    async def __anext__(self) -> Any:
        while self._live:
            w = self._live[self._k % len(self._live)]
            if self._bufs[w]:
                self._k += 1
                return self._bufs[w].popleft()
            self._waiting = w
            msg = await self.sup.receive(w)
            self._waiting = None
            if isinstance(msg, wire.Batch):
                # copied, never leased: a cache keeps these for the loader's lifetime
                self._bufs[w].extend(await self.sup.take(w, msg, lease=False))
            elif isinstance(msg, wire.PassEnd):
                self.sup.release(w, msg.slot)
                self._live.remove(w)
        raise StopAsyncIteration

    def behind(self) -> str:
        return self.sup.describe([self._waiting] if self._waiting is not None else self._live)
