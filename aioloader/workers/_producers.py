"""Producers over workers, and the parts every producer shares.

Workers' batches come from the supervisor as values: no producer sees a wire message or a slot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import BatchFailure, ResumeError
from .._stats import ArenaStats, WorkerStats
from ..pipeline._loads import ALL_SKIPPED, SkippedLoad
from ..pipeline._pipeline import INSTANCE_CHUNK
from ..plans._planning import Drawn
from ..plans._position import BlockStart, ShardPosition, ShardTracker, StreamPosition
from ..plans._sources import shard_spec
from ._phases import WorkerLost
from ._steps import Delivered, PassDone, Step
from ._supervising import Ended, Rewound, Supervising

# pass number -> index batches (blocking), or a user's batch sampler's, drawn as they are due
Plan = Callable[[int], Sequence[list[int]] | Drawn]
Pool = Supervising[Any]  # process or thread workers, or Ray actors


class CachedInstances(Sequence[Any]):
    """The instances of a cached pass, pickled by value for spawned workers: torch's pickler
    would move every tensor into a shared-memory segment of its own (one fd each)."""

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


class Plans:
    """Index batches, pass after pass, each planned in a thread: a plan takes as long as the
    epoch is long (a randperm of millions), or as a user's sampler takes (user code: never
    on the caller's loop, issue 33).

    ``ahead``: a pass may be planned before the previous one is consumed; not for a user's
    sampler, whose ``set_epoch`` the user calls between epochs. ``skip``: batches of the
    first pass delivered before a resume (issue 10); the plan is lazy, so skipping is free.
    """

    def __init__(self, plan: Plan, first_pass: int, *, ahead: bool, skip: int = 0) -> None:
        self.ahead = ahead
        self._plan = plan
        self._pass = first_pass
        self._batches: Sequence[list[int]] | Drawn | None = None  # lazy: made when due
        self._produced = 0
        self._skip = skip
        self._early: asyncio.Future[Sequence[list[int]] | Drawn] | None = None

    async def next(self) -> list[int] | PassDone:
        if self._batches is None:
            self._batches = await self._planned()
            self._produced, self._skip = self._skip, 0
            if isinstance(self._batches, Drawn):
                await self._skip_drawn(self._batches)
            elif self._produced > len(self._batches):
                raise self._shorter(len(self._batches))
            self._plan_early()
        if isinstance(self._batches, Drawn):
            if await _drawn(self._batches):
                self._produced += 1
                return self._batches.ready.popleft()
        elif self._produced < len(self._batches):
            self._produced += 1
            return self._batches[self._produced - 1]
        done = PassDone(self._produced == 0)
        self._batches = None
        self._pass += 1
        return done

    async def _skip_drawn(self, drawn: Drawn) -> None:
        """Draw (and drop) the batches delivered before a resume."""
        for k in range(self._produced):
            if not await _drawn(drawn):
                raise self._shorter(k)
            drawn.ready.popleft()

    def _shorter(self, has: int) -> ResumeError:
        """A resume past the end of this epoch, which has ``has`` batches."""
        return ResumeError(
            f"the state says {self._produced} batches of epoch {self._pass} were delivered, "
            f"but this epoch has {has}: the data or the sampler changed since the state was "
            "taken")

    def _plan_early(self) -> None:
        """The next pass, planned in the thread while this one is consumed (docs/performance.md:
        the next epoch's first batch). Two plans are held meanwhile (8 bytes an index)."""
        if self.ahead:
            early = asyncio.get_running_loop().run_in_executor(
                None, self._plan, self._pass + 1)
            early.add_done_callback(_retrieved)  # a loader dropped before it is awaited
            self._early = early

    async def _planned(self) -> Sequence[list[int]] | Drawn:
        early, self._early = self._early, None
        if early is not None and early.get_loop() is not asyncio.get_running_loop():
            early.cancel()  # made on another loop (the other face; another asyncio.run)
            early = None
        if early is None:
            return await asyncio.to_thread(self._plan, self._pass)
        return await early

    def restart(self, pass_no: int) -> None:
        """Pass ``pass_no`` from its start, planned when a batch is next asked for."""
        self.close()
        self._batches, self._pass, self._skip = None, pass_no, 0

    def close(self) -> None:
        """Drop a plan made early (its thread finishes it; nobody waits for it)."""
        early, self._early = self._early, None
        if early is not None:
            early.cancel()


async def _drawn(drawn: Drawn) -> bool:
    """Whether ``drawn`` has a batch ready, drawing the next chunk in a thread if need be."""
    return bool(drawn.ready) or await asyncio.to_thread(drawn.fill)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # raised where it is awaited; unlogged where it never is


# ---------------------------------------------------------------------- through workers

class _OnWorkers:
    """A producer whose work happens in a supervisor's workers."""

    sup: Pool
    _waiting: int | None = None  # the worker whose batch the consumer awaits

    async def start(self) -> None:
        await self.sup.start()

    def last_activity(self) -> float:
        return self.sup.last_heard

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        return self.sup.stats()

    def attach(self, private: bool) -> None:
        self.sup.attach()

    def detach(self) -> None:
        self.sup.detach()

    def heal(self, silence: float) -> bool:
        return self.sup.heal(silence)

    def _owing(self) -> list[int]:
        """The workers the next batch may come from."""
        return list(range(self.sup.num_workers))

    def behind(self) -> str:
        """For a timeout's message: the worker awaited, else those the batch may come from."""
        return self.sup.describe([self._waiting] if self._waiting is not None else self._owing())

    async def aclose(self, grace: float) -> None:
        await self.sup.aclose(grace)

    def close(self, grace: float) -> None:
        self.sup.close(grace)


class WorkerStream(_OnWorkers):
    """Each worker streams its shard; batches are taken round-robin, so a position resumes."""

    def __init__(self, sup: Pool, start: StreamPosition) -> None:
        self.sup = sup
        self.n = sup.num_workers
        self._shards = [ShardTracker(p) for p in start.shards]
        self._rr = start.next_shard
        self._pending = set(start.pending)
        self._produced = start.produced

    def position(self) -> StreamPosition:
        return StreamPosition(tuple(t.position for t in self._shards), self._rr,
                              tuple(sorted(self._pending)), self._produced)

    def _next_worker(self) -> int:
        for k in range(self.n):  # round-robin over the workers whose pass is not over yet
            w = (self._rr + k) % self.n
            if w in self._pending:
                return w
        raise AssertionError("no worker pending")

    async def next(self) -> Step:
        while True:
            if not self._pending:  # each pass starts at shard 0: a function of its pass alone
                done = PassDone(self._produced == 0)
                self._pending = set(range(self.n))
                self._produced = 0
                self._rr = 0
                return done
            w = self._next_worker()
            self._waiting = w
            try:
                got = await self.sup.receive(w)
            except WorkerLost:  # a new process goes on from the last batch taken
                await self.sup.restart(w, self._shards[w].position)
                continue
            except BatchFailure as failed:  # that batch's error, in its turn: w goes on
                self._waiting = None
                self._taken(w, failed.mark)
                raise
            self._waiting = None  # (kept on a timeout: behind() names it)
            if isinstance(got, Ended):
                self._pending.discard(w)
                self._shards[w].ended()
                continue
            assert isinstance(got, Delivered), f"{got!r} outside a rewind"
            self._taken(w, got.mark)
            return got

    def _taken(self, w: int, mark: Any) -> None:
        """Worker ``w``'s batch (or its failure) at ``mark`` is handed over."""
        self._shards[w].delivered(mark)
        self._rr = w + 1
        self._produced += 1

    async def rewind(self, pass_no: int) -> None:
        """Pass ``pass_no`` from its start, on these workers: what each sent before it says
        so is taken and dropped, as torch's persistent workers drop what they fetched for an
        iterator left early. A worker lost meanwhile is replaced at the pass's start."""
        for w in range(self.n):
            self.sup.rewind(w, pass_no)
        start = ShardPosition(pass_no)
        for w in range(self.n):
            self._waiting = w
            while True:
                try:
                    if isinstance(await self.sup.receive(w), Rewound):
                        break
                except WorkerLost:
                    await self.sup.restart(w, start)
                    break
                except BatchFailure:
                    continue  # dropped, as its batch would be
        self._waiting = None
        self._shards = [ShardTracker(start) for _ in range(self.n)]
        self._rr, self._pending, self._produced = 0, set(range(self.n)), 0

    def _owing(self) -> list[int]:
        return sorted(self._pending)


@dataclass(frozen=True, slots=True)
class _InFlight:
    seq: int
    worker: int
    indices: list[int]


class WorkerIndex(_OnWorkers):
    """Worker ``seq % n`` fetches batch ``seq`` of the plan, at most ``slots`` at a time."""

    def __init__(self, sup: Pool, plan: Plan, first_pass: int, slots: int, *,
                 plan_ahead: bool = True, skip: int = 0) -> None:
        self.sup = sup
        self.n = sup.num_workers
        self._plans = Plans(plan, first_pass, ahead=plan_ahead, skip=skip)
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
            self._queue.append(_InFlight(self._seq, w, step))
            self._seq += 1

    async def next(self) -> Step:
        if len(self._queue) < self._window:
            await self._fill()
        head = self._queue[0]
        if isinstance(head, PassDone):
            self._queue.popleft()
            return head
        got = await self._take(head)
        if got.mark == ALL_SKIPPED:  # every key of it failed and was skipped (reported)
            return await self.next()
        return got

    async def _take(self, head: _InFlight) -> Delivered:
        """The batch of ``head``, the queue's first, taken off the queue."""
        while True:
            try:
                got = await self.sup.receive(head.worker)
                break
            except WorkerLost:  # its batches not yet taken are asked of a new process
                await self.sup.restart(head.worker)
                for item in self._queue:
                    if isinstance(item, _InFlight) and item.worker == head.worker:
                        self.sup.request(item.worker, item.seq, item.indices)
            except BatchFailure:  # this batch's error, in its turn: the next one follows
                self._queue.popleft()
                raise
        self._queue.popleft()
        if not isinstance(got, Delivered) or got.seq != head.seq:
            raise AssertionError(f"expected batch {head.seq} from worker {head.worker}, "
                                 f"got {got!r}")
        return got

    async def rewind(self, pass_no: int) -> None:
        """Pass ``pass_no`` from its start: the batches in flight are taken and dropped."""
        while self._queue:
            head = self._queue[0]
            if isinstance(head, PassDone):
                self._queue.popleft()
                continue
            with contextlib.suppress(BatchFailure):  # dropped, as its batch would be
                await self._take(head)
        self._plans.restart(pass_no)

    def _owing(self) -> list[int]:
        head = self._queue[0] if self._queue else None
        return [head.worker] if isinstance(head, _InFlight) else super()._owing()

    async def aclose(self, grace: float) -> None:
        self._plans.close()
        await self.sup.aclose(grace)

    def close(self, grace: float) -> None:
        self._plans.close()
        self.sup.close(grace)


class WorkerInstances(_OnWorkers):
    """One pass of instances from workers, in chunks, interleaved one by one round-robin:
    the reader's own order where the loader shards (worker k holds k, k + n, ...)."""

    def __init__(self, sup: Pool) -> None:
        self.sup = sup
        self._bufs: list[collections.deque[Any]] = [collections.deque()
                                                    for _ in range(sup.num_workers)]
        self._live = list(range(sup.num_workers))
        self._taken = [0] * sup.num_workers  # instances received from each worker
        self._k = 0

    def _position(self, w: int) -> ShardPosition:
        """Where worker ``w``'s shard stands after the instances taken from it."""
        spec = self.sup.spec
        index, count = shard_spec(spec.source, spec.kind, w, spec.workers.num_workers, spec.rank,
                                  spec.world_size)
        taken = self._taken[w]
        raw = index + (taken - 1) * count + 1 if taken else 0
        return ShardPosition(spec.first_pass, BlockStart(0, raw, None))

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
            try:
                got = await self.sup.receive(w, lease=False)  # a cache keeps these: copies
            except WorkerLost:  # a new process reads on after the instances taken
                await self.sup.restart(w, self._position(w))
                continue
            self._waiting = None
            if isinstance(got, Ended):
                self._live.remove(w)
            elif isinstance(got, Delivered):  # (one pass of instances is never rewound)
                # keys skipped on error count for the position, and go no further
                self._bufs[w].extend(x for x in got.value if not isinstance(x, SkippedLoad))
                self._taken[w] += len(got.value)
        if out:
            return Delivered(out)
        return PassDone(False)

    def _owing(self) -> list[int]:
        return self._live
