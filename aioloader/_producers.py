"""Producers: what a session drives to get batches, in this process or through workers.

Each answers ``next()`` with a :class:`Delivered` value or a :class:`PassDone` at the end
of one pass over the data; the loader decides what an epoch is. Producers never see a
wire message or a slot: workers' batches come from the supervisor as values.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import os
import pickle
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._pipeline import BatchOptions, PassBatcher, collate_with, sync_batches
from ._session import Activity, PassDone, Producer, Step
from ._sources import Kind, fetch, is_async, open_shard
from ._supervisor import Delivered, Ended, Supervisor
from ._worker import Plan as Role
from ._worker import WorkerSpec

Plan = Callable[[int], Sequence[list[int]]]  # pass number -> index batches (blocking: a thread)
INSTANCE_CHUNK = 64
T = TypeVar("T")


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


class _Plans:
    """Index batches, pass after pass; each pass is planned in a thread, off the loop.

    ``ahead``: a pass may be planned before the previous one is consumed. True for the
    loader's own sampling (a pure function of seed and pass); False for a user's sampler,
    whose ``set_epoch`` the user calls between epochs.
    """

    def __init__(self, plan: Plan, first_pass: int, *, ahead: bool = True) -> None:
        self.ahead = ahead
        self._plan = plan
        self._pass = first_pass
        self._batches: Sequence[list[int]] | None = None  # lazy: a batch is made when due
        self._produced = 0

    async def next(self) -> list[int] | PassDone:
        if self._batches is None:
            self._batches = await asyncio.to_thread(self._plan, self._pass)
            self._produced = 0
        if self._produced < len(self._batches):
            self._produced += 1
            return self._batches[self._produced - 1]
        done = PassDone(self._produced == 0)
        self._batches = None
        self._pass += 1
        return done


# ---------------------------------------------------------------------- in this process

class _InProcess:
    """No workers: nothing to start, watch or reap; blocking work runs in one thread.

    One dedicated thread, not asyncio's default executor: that one alternates between its
    threads, each with its own malloc arena (a freed 9.6 MB batch goes back to the kernel
    and faults in again: 250-1100 page faults a batch) and its own OpenMP team (issue 9;
    image batches 0.57x -> 1.02x torch's num_workers=0).
    """

    def __init__(self) -> None:
        self.activity = Activity()
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
                 collate_fn: Callable[[list[Any]], Any] | None, *, inline: bool) -> None:
        super().__init__()
        self._dataset = dataset
        self._collate = collate_with(collate_fn)
        self._plans = _Plans(plan, first_pass)
        self._inline_ok = inline  # no timeout to honour: a private loop may block

    def _fetch(self, indices: list[int]) -> Any:
        # Progress per sample matters only to a timeout (then nothing runs inline).
        each = None if self._inline_ok else self.activity.touch
        return self._collate(fetch(self._dataset, indices, each))

    async def next(self) -> Step:
        indices = await self._plans.next()
        if isinstance(indices, PassDone):
            return indices
        if self.private and self._inline_ok:
            return Delivered(self._fetch(indices))
        return Delivered(await self.offload(self._fetch, indices))

    def behind(self) -> str:
        return "the dataset in this process (num_workers=0)"


_END = object()


class LocalStream(_InProcess):
    """Passes over a reader or IterableDataset, batched and collated in this process."""

    def __init__(self, source: Any, kind: Kind, data_path: Any, options: BatchOptions,
                 collate_fn: Callable[[list[Any]], Any] | None,
                 seed_for: Callable[[int], int], first_pass: int, rank: int,
                 world_size: int) -> None:
        super().__init__()
        self._open: Callable[[], Any] = lambda: open_shard(source, kind, data_path, 0, 1,
                                                            rank, world_size)
        self._options = options
        self._collate = collate_with(collate_fn)
        self._seed_for = seed_for
        self._pass_no = first_pass
        self._pass: _LocalPass | None = None

    async def next(self) -> Step:
        if self._pass is None:
            batcher = PassBatcher(self._options, self._seed_for(self._pass_no))
            self._pass = _LocalPass(self._open(), batcher, self._collate, self.activity.touch,
                                    self.offload)
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

    def __init__(self, stream: Any, batcher: PassBatcher, collate: Callable[[list[Any]], Any],
                 touch: Callable[[], None], offload: Callable[..., Awaitable[Any]]) -> None:
        self.collate = collate
        self.touch = touch
        self.offload = offload
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
            self.sync_it = (collate(g) for g in sync_batches(_touching(stream, touch), batcher))

    async def next(self) -> Any:
        """The next collated batch, or _END."""
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
                self.touch()
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
            with contextlib.suppress(ValueError):  # still running in its thread: it ends
                it.close()  # type: ignore[attr-defined]


def _touching(stream: Any, touch: Callable[[], None]) -> Iterator[Any]:
    for item in stream:
        touch()
        yield item


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
                 world_size: int) -> None:
        super().__init__()
        self._stream = open_shard(source, kind, data_path, 0, 1, rank, world_size)
        self._sync: Iterator[Any] | None = None
        self._async: Any = None
        self._done = False

    def _chunk(self) -> list[Any]:
        assert self._sync is not None
        return list(itertools.islice(self._sync, INSTANCE_CHUNK))

    async def next(self) -> Step:
        if self._done:
            return PassDone(False)
        if is_async(self._stream):
            if self._async is None:
                self._async = self._stream.__aiter__()  # type: ignore[union-attr]
            chunk = []
            async for item in self._async:
                self.activity.touch()
                chunk.append(item)
                if len(chunk) >= INSTANCE_CHUNK:
                    break
        else:
            if self._sync is None:
                self._sync = _touching(self._stream, self.activity.touch)
            chunk = await self.offload(self._chunk)
        if len(chunk) < INSTANCE_CHUNK:
            self._done = True
        return Delivered(chunk)

    def behind(self) -> str:
        return "the reader in this process (num_workers=0)"

    async def aclose(self, grace: float) -> None:
        aclose = getattr(self._async, "aclose", None)
        if aclose is not None:
            await aclose()
        self.close(grace)

    def close(self, grace: float) -> None:
        it, self._sync = self._sync, None
        if it is not None:
            with contextlib.suppress(ValueError):
                it.close()  # type: ignore[attr-defined]
        self.stop_thread()


# ---------------------------------------------------------------------- through workers

class _OnWorkers:
    """A producer whose work happens in a supervisor's workers."""

    sup: Supervisor

    async def start(self) -> None:
        await self.sup.start()

    def last_activity(self) -> float:
        return self.sup.last_heard

    def attach(self, private: bool) -> None:
        self.sup.attach()

    def detach(self) -> None:
        self.sup.detach()

    async def aclose(self, grace: float) -> None:
        await self.sup.aclose(grace)

    def close(self, grace: float) -> None:
        self.sup.close(grace)


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
        """Round-robin over the workers whose pass is not over yet."""
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
            got = await self.sup.receive(w)
            self._waiting = None
            if isinstance(got, Ended):
                self._pending.discard(w)
                continue
            self._rr = w + 1
            self._produced += 1
            return got

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
    ``slots`` requests are outstanding per worker, which is also how many slots it has.
    """

    def __init__(self, sup: Supervisor, plan: Plan, first_pass: int, slots: int, *,
                 plan_ahead: bool = True) -> None:
        self.sup = sup
        self.n = sup.num_workers
        self._plans = _Plans(plan, first_pass, ahead=plan_ahead)
        self._window = self.n * slots
        self._queue: collections.deque[_InFlight | PassDone] = collections.deque()
        self._seq = 0

    async def _fill(self) -> None:
        while len(self._queue) < self._window:
            if self._queue and isinstance(self._queue[-1], PassDone) and (
                    self._queue[-1].empty or not self._plans.ahead):
                return  # the next pass is planned once this one is consumed
            step = await self._plans.next()
            if isinstance(step, PassDone):
                self._queue.append(step)
                continue
            w = self._seq % self.n
            self.sup.request(w, self._seq, step)
            self._queue.append(_InFlight(self._seq, w))
            self._seq += 1

    async def next(self) -> Step:
        if len(self._queue) < self._window:
            await self._fill()
        head = self._queue[0]
        if isinstance(head, PassDone):
            self._queue.popleft()
            return head
        got = await self.sup.receive(head.worker)
        self._queue.popleft()
        if not isinstance(got, Delivered) or got.seq != head.seq:
            raise AssertionError(f"expected batch {head.seq} from worker {head.worker}, "
                                 f"got {got!r}")
        return got

    def behind(self) -> str:
        head = self._queue[0] if self._queue else None
        ids = [head.worker] if isinstance(head, _InFlight) else list(range(self.n))
        return self.sup.describe(ids)


class WorkerInstances(_OnWorkers):
    """One pass of instances from workers started with the "instances" plan, in chunks.

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

    async def next(self) -> Step:
        out: list[Any] = []
        while self._live and len(out) < INSTANCE_CHUNK:
            w = self._live[self._k % len(self._live)]
            if self._bufs[w]:
                self._k += 1
                out.append(self._bufs[w].popleft())
                continue
            if out:
                break  # hand over what is here before waiting
            self._waiting = w
            got = await self.sup.receive(w, lease=False)  # a cache keeps these: copies
            self._waiting = None
            if isinstance(got, Ended):
                self._live.remove(w)
            else:
                self._bufs[w].extend(got.value)
        if out:
            return Delivered(out)
        return PassDone(False)

    def behind(self) -> str:
        return self.sup.describe([self._waiting] if self._waiting is not None else self._live)


# ---------------------------------------------------------------------- making them

@dataclass(frozen=True)
class Setup:
    """A loader's options as data: how its producers (and their workers) are made.

    The loader asks for a producer by what it wants (a stream, index batches, one pass of
    instances); only here are worker specs built and supervisors made.
    """

    source: Any
    kind: Kind
    data_path: Any
    options: BatchOptions
    collate_fn: Callable[[list[Any]], Any] | None
    num_workers: int
    start_method: str
    prefetch: int
    zero_copy: bool
    seed: int
    rank: int
    world_size: int
    inline_ok: bool  # no timeout: the sync adapter's own loop may fetch inline

    def _supervisor(self, role: Role, source: Any, kind: Kind, first_pass: int) -> Supervisor:
        spec = WorkerSpec(
            source=source, kind=kind, data_path=self.data_path, plan=role,
            options=self.options, collate_fn=self.collate_fn, worker_id=0,
            num_workers=self.num_workers, rank=self.rank, world_size=self.world_size,
            seed=self.seed, first_pass=first_pass, slots=self.prefetch,
            parent_pid=os.getpid() if self.start_method != "forkserver" else 0,
            progress=not self.inline_ok)
        return Supervisor(spec, self.num_workers, self.start_method, lease=self.zero_copy)

    def stream(self, first_pass: int, seed_for: Callable[[int], int]) -> Producer:
        """Batches of passes over a streaming source, each worker over its shard."""
        if self.num_workers == 0:
            return LocalStream(self.source, self.kind, self.data_path, self.options,
                               self.collate_fn, seed_for, first_pass, self.rank,
                               self.world_size)
        return WorkerStream(self._supervisor("stream", self.source, self.kind, first_pass))

    def index(self, data: Sequence[Any], plan: Plan, first_pass: int, *,
              plan_ahead: bool) -> Producer:
        """Index batches of ``data`` (a dataset, or cached instances), planned by ``plan``."""
        if self.num_workers == 0:
            return LocalIndex(data, plan, first_pass, self.collate_fn, inline=self.inline_ok)
        return WorkerIndex(self._supervisor("index", data, Kind.MAP, first_pass), plan,
                           first_pass, self.prefetch, plan_ahead=plan_ahead)

    def instances(self, pass_no: int) -> Producer:
        """One pass of a streaming source's instances, in chunks (to fill a cache)."""
        if self.num_workers == 0:
            return LocalInstances(self.source, self.kind, self.data_path, self.rank,
                                  self.world_size)
        return WorkerInstances(self._supervisor("instances", self.source, self.kind, pass_no))
