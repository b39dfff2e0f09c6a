"""Producers that work in this process (``num_workers=0``): the pipeline, iterated here, its
blocking work (a sync source, fetching, collating) in one helper thread of their own."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from .._errors import BatchFailure
from .._stats import NO_ARENA, ArenaStats, WorkerStats
from ..pipeline._loads import (
    SKIP_REPORT,
    LoadOptions,
    LoadStage,
    SkipLog,
    SkippedLoad,
    ops_on_this_thread,
)
from ..pipeline._pipeline import Batch, BatchOptions, Boundary, InOrder, Pipeline, Step
from ..pipeline._recycle import MEMORY, MIN_BYTES
from ..pipeline._stacking import (
    TORCH_COLLATE_IN_THREADS,
    ConsumerWaits,
    copy_helper,
    use_allocator,
)
from ..plane._codec import tensors_nbytes
from ..plans._position import PASS_START, ShardPosition, ShardTracker, StreamPosition
from ..plans._sources import Kind, Unhooked, aclose, unhooked
from ._passes import Build, Event, PassEnd, passes
from ._producers import Plan, Plans
from ._steps import Activity, Delivered, PassDone

T = TypeVar("T")
Work = Iterator[Any] | Unhooked[Any] | InOrder[Any, Any]  # one pass's iterator


class _InProcess:
    """No workers: nothing to start, watch or reap; blocking work runs in one thread, not
    asyncio's default executor, whose threads each have their own malloc arena (a freed
    9.6 MB batch faulted in again: 250-1100 page faults a batch) and OpenMP team (issue 9).
    Where user code runs (issue 33): docs/architecture.md; with a ``timeout``, always in the
    thread (the timer needs the loop free to fire).
    """

    def __init__(self, pipe: Pipeline, *, timed: bool, skips: SkipLog | None,
                 on_loop: bool = False) -> None:
        self.pipe = pipe
        self.activity = Activity()
        self.timed = timed  # without a timeout, no clock read per instance
        self.touch: Callable[[], None] | None = self.activity.touch if timed else None
        self.private = False  # the loop is the sync adapter's own: blocking it is fine
        self.on_loop = on_loop  # fetch_on_loop=True: the user let fetches block the loop
        self._skips = skips if skips is not None else SkipLog()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None  # its helper
        # Only while the consumer waits for the fetch does the helper copy: batches ahead run
        # while the consumer's step may hold every core, and a chunk the idle-priority helper
        # began would wait for that step to end.
        self.waiting = ConsumerWaits(now=True)
        self.reuse = True  # until a batch shows it has no large tensor
        self._work: Work | None = None  # the pass's iterator
        self._stage: LoadStage | None = None  # the pass's load stage, entered on this loop

    async def start(self) -> None:
        pass

    async def next(self) -> Delivered | PassDone:
        """The next batch (or chunk) or pass end; the source's own skips go to the skip log."""
        token = SKIP_REPORT.set(self._skips.add)
        try:
            return await self._next()
        finally:
            SKIP_REPORT.reset(token)

    _next: Callable[[], Awaitable[Delivered | PassDone]]  # the producer's own step

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """``fn(*args)`` queued to the fetch thread."""
        if self._thread is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="aioloader-copy", initializer=_copy_thread)
            self._thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="aioloader-local", initializer=_fetch_thread,
                initargs=(self._copier, self.waiting))
        return self._thread.submit(contextvars.copy_context().run, fn, *args)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    @property
    def inline(self) -> bool:
        """Whether the next fetch runs on this loop (see the class docstring)."""
        return (self.private or self.on_loop) and not self.timed

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            return fn(*args)
        return await self.offload(fn, *args)

    def collate(self, items: list[Any], indices: list[Any] | None = None) -> Any:
        """``items`` collated, large tensors in reused memory (``pipeline._recycle``, torch's
        ``default_collate`` too) while batches are large; small ones skip that (10-14 us a
        batch: 12 % of tiny's)."""
        if not self.reuse:
            return self.pipe.collate(items, indices)
        with use_allocator(MEMORY), TORCH_COLLATE_IN_THREADS.scope():
            return self.pipe.collate(items, indices)

    def delivered(self, batch: Any, mark: Any = None) -> Delivered:
        """``batch``; its size decides whether the next is built in reused memory."""
        nbytes = tensors_nbytes(batch)
        self.reuse = nbytes >= MIN_BYTES
        return Delivered(batch, mark=mark, nbytes=nbytes)

    def stop_thread(self) -> None:
        thread, self._thread = self._thread, None
        copier, self._copier = self._copier, None
        for executor in (thread, copier):
            if executor is not None:
                executor.shutdown(wait=False)  # a call still running ends on its own

    def last_activity(self) -> float:
        return self.activity()

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        return (), NO_ARENA

    def attach(self, private: bool) -> None:
        self.private = private

    def detach(self) -> None:
        self.private = False

    def heal(self, silence: float) -> bool:
        return False  # nothing to kill in this process: a silent fetch times out

    def behind(self) -> str:
        what = "dataset" if self.pipe.kind is Kind.MAP else "reader"
        return f"the {what} in this process (num_workers=0)"

    async def enter_stage(self) -> LoadStage | None:
        made = self.pipe.stage(None, self._skips.add)
        if made is not None:
            self._stage = await made.__aenter__()
        return self._stage

    async def end_pass(self) -> None:
        """Close the pass's iterator, then leave its load stage."""
        work, self._work = self._work, None
        if isinstance(work, (Unhooked, InOrder)):
            await work.aclose()
        else:
            _close_sync(work)
        stage, self._stage = self._stage, None
        if stage is not None:
            await stage.__aexit__(None, None, None)

    def _stop(self) -> None:
        """What a producer drops on either close."""

    async def aclose(self, grace: float) -> None:
        self._stop()
        await self.end_pass()
        self.stop_thread()

    def close(self, grace: float) -> None:
        """No loop to wait on here: cancelling is what is left."""
        self._stop()
        work, self._work = self._work, None
        if isinstance(work, InOrder):
            work.abandon()
        elif not isinstance(work, Unhooked):
            _close_sync(work)
        stage, self._stage = self._stage, None
        if stage is not None:
            stage.abandon()
        self.stop_thread()


def _fetch_thread(copier: concurrent.futures.Executor, waiting: ConsumerWaits) -> None:
    """Torch on one OpenMP thread; large stacks shared with ``copier`` (``copy_helper``)."""
    ops_on_this_thread()
    copy_helper(copier, waiting)


def _copy_thread() -> None:
    """The copy helper's set-up: torch on one OpenMP thread and, on Linux, ``SCHED_IDLE``
    where it can be set (docs/performance.md measures why)."""
    ops_on_this_thread()
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE,
                                  os.sched_param(0))


def _close_sync(it: Iterator[Any] | None) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        with contextlib.suppress(ValueError):  # still running in its thread: it ends
            close()


class LocalIndex(_InProcess):
    """Index batches of a map-style source, fetched and collated in this process; in the
    thread, ``ahead`` (``prefetch``) in front of the consumer, so that the thread hop is not
    waited for (docs/performance.md); with a load stage, their loads overlap on this loop."""

    def __init__(self, dataset: Any, plan: Plan, first_pass: int,
                 collate_fn: Callable[[list[Any]], Any] | None, *, timed: bool,
                 skip: int = 0, loads: LoadOptions | None = None,
                 skips: SkipLog | None = None, ahead: int = 4, plan_ahead: bool,
                 on_loop: bool = False) -> None:
        super().__init__(Pipeline(dataset, Kind.MAP, None, None, collate_fn, loads),
                         timed=timed, skips=skips, on_loop=on_loop)
        self._plans = Plans(plan, first_pass, ahead=plan_ahead, skip=skip)
        self._ahead = ahead
        self._ended: PassDone | None = None
        # Fetches queued to the thread; a pass end stops the queue (a user's sampler sees
        # set_epoch before the next pass is planned).
        self._queue: collections.deque[concurrent.futures.Future[Any] | PassDone] = (
            collections.deque())

    def _fetch(self, indices: list[int]) -> Any:
        try:
            return self.collate(self.pipe.fetch(indices, self.touch), indices)
        except Exception as exc:  # noqa: BLE001 - that batch's error: the epoch goes on
            raise BatchFailure(-1, exc) from None

    async def _next(self) -> Delivered | PassDone:
        if self.pipe.loads is not None:
            return await self._next_loaded()
        if self._queue or not self.inline:
            return await self._next_ahead()
        indices = await self._plans.next()
        if isinstance(indices, PassDone):
            return indices
        return self.delivered(self._fetch(indices))

    async def _next_ahead(self) -> Delivered | PassDone:
        """The queue's head, ``ahead`` fetches kept behind it; a cancelled wait loses nothing."""
        queue = self._queue
        while (len(queue) <= self._ahead and not self.inline
               and not (queue and isinstance(queue[-1], PassDone))):
            step = await self._plans.next()
            queue.append(step if isinstance(step, PassDone) else self.submit(self._fetch, step))
        head = queue[0]
        if isinstance(head, PassDone):
            queue.popleft()
            return head
        if head.done():  # built ahead: no trip through the loop (a wake-up, 3 callbacks)
            queue.popleft()
            return self.delivered(head.result())
        self.waiting.now = True
        try:
            batch = await asyncio.shield(asyncio.wrap_future(head))
        except asyncio.CancelledError:
            raise
        except BaseException:
            queue.popleft()  # raised as the inline fetch would; the next batch is next
            raise
        finally:
            self.waiting.now = False
        queue.popleft()
        return self.delivered(batch)

    def _stop(self) -> None:
        """Fetches not started are cancelled; one running ends on its own."""
        self._plans.close()
        queue, self._queue = self._queue, collections.deque()
        for step in queue:
            if not isinstance(step, PassDone):
                step.cancel()

    async def _next_loaded(self) -> Delivered | PassDone:
        while True:
            if self._work is None:
                stage = await self.enter_stage()
                assert stage is not None
                self._work = InOrder(self._pass(), functools.partial(
                    stage.fetch, self.pipe.source), self._ahead)
            assert isinstance(self._work, InOrder)
            try:
                indices, group = await self._work.__anext__()
            except StopAsyncIteration:
                await self.end_pass()
                assert self._ended is not None
                ended, self._ended = self._ended, None
                return ended
            if self.touch is not None:
                self.touch()
            if not group:
                continue  # every key of this batch was skipped (and reported)
            batch = await self.run(self.collate, group, indices)
            return self.delivered(batch)

    async def _pass(self) -> AsyncIterator[list[int]]:
        """The index batches of this pass; its end is kept for :meth:`next`."""
        while not isinstance(step := await self._plans.next(), PassDone):
            yield step
        self._ended = step


class LocalStream(_InProcess):
    """Passes over a reader or IterableDataset (a sync one in the thread), collated here."""

    def __init__(self, source: Any, kind: Kind, data_path: Any, options: BatchOptions,
                 collate_fn: Callable[[list[Any]], Any] | None,
                 seed_for: Callable[[int], int], start: ShardPosition, rank: int,
                 world_size: int, *, timed: bool, produced: int = 0,
                 loads: LoadOptions | None = None, skips: SkipLog | None = None) -> None:
        super().__init__(Pipeline(source, kind, data_path, options, collate_fn, loads,
                                  rank=rank, world_size=world_size), timed=timed, skips=skips)
        self._shard = ShardTracker(start)
        self._produced = produced
        self._passes: Unhooked[Event[Delivered | BatchFailure]] = unhooked(passes(
            start, lambda start, seed: unhooked(self._built(start, seed)), seed_for))

    def position(self) -> StreamPosition:
        return StreamPosition((self._shard.position,), 0, (0,), self._produced)

    async def _next(self) -> Delivered | PassDone:
        event = await anext(self._passes)
        if isinstance(event, Build):
            batch: Delivered | BatchFailure = event.batch
            self._shard.delivered(batch.mark)
            self._produced += 1
            if isinstance(batch, BatchFailure):  # that batch's error: the pass goes on
                raise batch
            return batch
        assert isinstance(event, PassEnd)  # no retirement here: never a hand-over
        done = PassDone(self._produced == 0)
        self._shard.ended()
        self._produced = 0
        return done

    async def _built(self, start: ShardPosition,
                     seed: int) -> AsyncIterator[Delivered | BatchFailure | Boundary]:
        """One pass's batches, collated, inside its load stage (nothing retires here)."""
        stage = await self.enter_stage()
        self._work = steps = self.pipe.batches(start, seed, stage, touch=self.touch,
                                               offload=self.offload)
        try:
            while (got := await self._next_batch(steps)) is not None:
                yield got if isinstance(got, BatchFailure) else self.delivered(*got)
        finally:
            await self.end_pass()

    async def _next_batch(self, steps: Iterator[Step] | Unhooked[Step],
                          ) -> tuple[Any, Any] | BatchFailure | None:
        """The next (collated batch, mark) of the pass, its failure, or None at its end."""
        if isinstance(steps, Unhooked):
            async for step in steps:
                if isinstance(step, Batch):
                    return self._made(step)
            return None
        made = (self._made(step) for step in steps if isinstance(step, Batch))
        return await self.offload(next, made, None)  # read and collated in the thread

    def _made(self, batch: Batch) -> tuple[Any, Any] | BatchFailure:
        """``batch`` collated, with its mark, or its failure: the pass goes on (issue 32)."""
        if batch.error is not None:
            return BatchFailure(-1, batch.error, batch.mark)
        try:
            return self.collate(batch.items), batch.mark
        except Exception as exc:  # noqa: BLE001 - that batch's error: the pass goes on
            return BatchFailure(-1, exc, batch.mark)

    async def aclose(self, grace: float) -> None:
        await aclose(self._passes)
        await super().aclose(grace)


class LocalInstances(_InProcess):
    """One pass of instances read in this process, in chunks."""

    def __init__(self, source: Any, kind: Kind, data_path: Any, rank: int,
                 world_size: int, *, timed: bool, loads: LoadOptions | None = None,
                 skips: SkipLog | None = None) -> None:
        super().__init__(Pipeline(source, kind, data_path, None, None, loads, rank=rank,
                                  world_size=world_size), timed=timed, skips=skips)
        self._done = False

    async def _next(self) -> Delivered | PassDone:
        if self._done:
            return PassDone(False)
        if self._work is None:
            stage = await self.enter_stage()
            self._work = self.pipe.chunks(PASS_START, stage, touch=self.touch,
                                          offload=self.offload)
        chunks = self._work
        if isinstance(chunks, Unhooked):
            chunk = await anext(chunks, None)
        else:
            chunk = await self.offload(next, chunks, None)
        if chunk is None:
            self._done = True
            await self.end_pass()
            return PassDone(False)
        return Delivered([x for x in chunk if not isinstance(x, SkippedLoad)])
