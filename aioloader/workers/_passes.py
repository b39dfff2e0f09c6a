"""A worker's passes, whatever carries its batches: its set-up, then pass after pass.

Written once (issue 34); building a batch and sending it are the transport's."""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch.utils.data import IterDataPipe
from torch.utils.data.graph_settings import apply_random_seed

from .._config import Workers
from .._info import WorkerInfo, set_worker_info
from ..pipeline._loads import ALL_SKIPPED, LoadStage, Report
from ..pipeline._pipeline import Batch, Boundary, Pipeline, Touch, each
from ..plans._position import ShardPosition
from ..plans._samplers import derive_seed
from ..plans._sources import Unhooked
from ._spec import WorkerSpec

B = TypeVar("B")


@dataclass(frozen=True, slots=True)
class Build(Generic[B]):
    """Build batch ``seq`` of the pass (a :class:`Batch`, a chunk, ...) and hand it on."""

    seq: int
    batch: B


@dataclass(frozen=True, slots=True)
class PassEnd:
    """Pass ``pass_no`` ended after ``batches`` batches (those of this worker's run)."""

    pass_no: int
    batches: int


@dataclass(frozen=True, slots=True)
class HandOver:
    """The worker retires: its successor starts at ``position``. Nothing follows."""

    position: ShardPosition


Event = Build[B] | PassEnd | HandOver
# One pass's steps, from its start and with its seed: batches and block boundaries.
OpenPass = Callable[[ShardPosition, int], Iterable[B | Boundary] | Unhooked[B | Boundary]]


async def passes(start: ShardPosition, open_pass: OpenPass[B], begin: Callable[[int], int],
                 retirement: Retirement | None = None, *,
                 one_pass: bool = False) -> AsyncGenerator[Event[B], None]:
    """The worker's passes from ``start`` on, as events.

    ``begin(pass_no)``: called as each pass begins; the pass's seed. A batch counts (for
    ``retirement``) once the caller asks for the next event. A worker due to retire goes on
    to the next block boundary (or the pass end), where a successor can begin; a resumed
    worker's frontier holds in its first pass only. ``one_pass``: instances for a cache.
    """
    pass_no = start.pass_no
    while True:
        seed = begin(pass_no)
        sent = 0
        due = False
        async with contextlib.aclosing(each(open_pass(start, seed))) as steps:
            async for step in steps:
                if isinstance(step, Boundary):
                    if due:  # retiring, at a block boundary: the successor starts here
                        yield HandOver(ShardPosition(pass_no, step.start,
                                                     frontier=start.frontier))
                        return
                    continue
                yield Build(sent, step)
                sent += 1
                due = (retirement is not None and retirement.batch_done()) or due
        yield PassEnd(pass_no, sent)
        if one_pass:
            return
        pass_no += 1
        start = ShardPosition(pass_no)
        if due:
            yield HandOver(start)
            return


class Retirement:
    """When a worker should hand its work to a successor (recycling): after
    ``max_batches`` batches, or once its own memory passes ``max_rss`` (a big forked
    dataset's pages turn private as Python's refcounts touch them: torch issue 13246)."""

    def __init__(self, workers: Workers) -> None:
        self.max_batches = workers.max_batches
        self.max_rss = workers.max_rss
        self.batches = 0

    def batch_done(self) -> bool:
        """Count a batch; True when the worker should retire now."""
        self.batches += 1
        if self.max_batches is not None and self.batches >= self.max_batches:
            return True
        # One read of smaps_rollup a batch: ~0.1-1 ms, against a batch of real work.
        return self.max_rss is not None and own_memory() > self.max_rss


def own_memory() -> int:
    """Bytes this process holds alone (USS), not its RSS: a fork shares its parent's pages."""
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:  # not Linux: the peak RSS is the best there is
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total = 0
    for line in text.splitlines():
        if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


class Seeding:
    """A worker's :class:`WorkerInfo` and global RNGs: set once as it starts (before
    ``worker_init_fn``), then as each pass begins. The first pass keeps what
    ``worker_init_fn`` seeded; a thread worker never reseeds the process it shares."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._seeded = spec.seed_for(spec.first_pass)
        self._set(self._seeded, reseed=True)

    def begin(self, pass_no: int) -> int:
        """Pass ``pass_no`` begins: its seed, set in the worker info and the RNGs."""
        seed = self.spec.seed_for(pass_no)
        self._set(seed, reseed=seed != self._seeded)  # not again: worker_init_fn's stays
        self._seeded = -1
        if isinstance(self.spec.source, IterDataPipe):
            # Its shufflers seeded alike in every worker, as torch does: a .shuffle() before
            # .sharding_filter() draws one order that the shards partition (each drew its
            # own before, and the shards overlapped).
            shared = torch.Generator()
            shared.manual_seed(derive_seed(self.spec.seed, pass_no) & ((1 << 63) - 1))
            apply_random_seed(self.spec.source, shared)
        return seed

    def _set(self, seed: int, reseed: bool) -> None:
        spec = self.spec
        threaded = spec.workers.threaded
        set_worker_info(WorkerInfo(spec.workers.num_workers, spec.worker_id, seed, spec.rank,
                                   spec.world_size), dataset=spec.source, thread=threaded)
        if reseed and not threaded:  # Python's, torch's and numpy's global RNGs
            random.seed(seed)
            torch.manual_seed(seed)
            with contextlib.suppress(ImportError):
                import numpy as np

                np.random.seed(seed % (1 << 32))


@dataclass
class Serving:
    """A worker once set up; its retirement counts across its passes, rewound or not."""

    spec: WorkerSpec
    pipe: Pipeline
    stage: LoadStage | None
    seeding: Seeding
    retirement: Retirement

    def passes(self, touch: Touch | None = None, start: ShardPosition | None = None,
               ) -> AsyncGenerator[Event[Batch | list[Any]], None]:
        """The stream's passes from ``start`` (None: the spec's), or instances' one pass."""
        spec, pipe, stage = self.spec, self.pipe, self.stage
        start = start if start is not None else spec.start()
        if spec.plan == "instances":
            def chunks(start: ShardPosition, seed: int) -> Any:
                return pipe.chunks(start.start, stage, touch=touch)

            return passes(start, chunks, self.seeding.begin, one_pass=True)

        def batches(start: ShardPosition, seed: int) -> Any:
            return pipe.batches(start, seed, stage, touch=touch)

        return passes(start, batches, self.seeding.begin, self.retirement)


class Outlet(Protocol):
    """How a built batch leaves its worker: a process's arena slot and wire message, or a
    Ray call's reply. ``emit`` builds the batch with ``make()`` (a process's collate
    allocates in the slot); it and ``failed``: False once the parent went away."""

    async def emit(self, seq: int, make: Callable[[], Any], mark: Any) -> bool: ...

    async def failed(self, seq: int, exc: Exception, mark: Any) -> bool: ...

    async def retire(self) -> None: ...


async def build(worker: Serving, out: Outlet, event: Build[Batch | list[Any]]) -> bool:
    """Send one batch of the stream (or chunk of instances); False once the parent is gone.
    A batch whose making raised (the source's error, or the collate's) is that batch's
    error, and the stream goes on, as torch's does (issue 32); a chunk of instances has no
    batch to fail: it ends the worker."""
    batch = event.batch
    if not isinstance(batch, Batch):
        return await out.emit(event.seq, lambda: batch, None)
    if batch.error is not None:
        return await out.failed(event.seq, batch.error, batch.mark)
    try:
        return await out.emit(event.seq, functools.partial(worker.pipe.collate, batch.items),
                              batch.mark)
    except Exception as exc:  # noqa: BLE001 - that batch's error; the stream goes on
        return await out.failed(event.seq, exc, batch.mark)


async def answer(worker: Serving, out: Outlet, seq: int, indices: list[int],
                 loaded: list[Any] | None = None, touch: Touch | None = None) -> bool:
    """Send index batch ``seq``: ``indices`` fetched (or ``loaded`` by the load stage) and
    collated, or :data:`ALL_SKIPPED` when the stage skipped every key; False once the worker
    stops (its parent went away, or it retired). The dataset's or the collate's error is
    that batch's and the next task follows, as torch's; with a load stage, it ends the
    worker. A failed batch does not count for recycling."""
    pipe = worker.pipe
    try:
        items = pipe.fetch(indices, touch) if loaded is None else loaded
        mark: str | None = None
        if items or loaded is None:  # with the indices, a CollateKeyError names the sample's
            make: Callable[[], Any] = functools.partial(pipe.collate, items, indices)
        else:  # the stage skipped every key
            make, mark = (lambda: None), ALL_SKIPPED
        if not await out.emit(seq, make, mark):
            return False
    except Exception as exc:
        if loaded is not None:
            raise
        return await out.failed(seq, exc, None)
    if worker.retirement.batch_done():
        await out.retire()
        return False
    return True


@contextlib.asynccontextmanager
async def serving(spec: WorkerSpec, report: Report) -> AsyncIterator[Serving]:
    """A worker's set-up, in torch's order: worker info and seeds, then ``worker_init_fn``
    (a restarted or recycled worker's too), then the pipeline and its load stage, whose
    skipped keys go to ``report``."""
    seeding = Seeding(spec)
    if spec.workers.init_fn is not None:
        spec.workers.init_fn(spec.worker_id)
    pipe = spec.pipeline()
    async with contextlib.AsyncExitStack() as stack:
        made = pipe.stage(spec.worker_id, report=report)
        stage = await stack.enter_async_context(made) if made is not None else None
        yield Serving(spec, pipe, stage, seeding, Retirement(spec.workers))
