"""The Ray actor of ``worker_type="ray"``: one worker's pipeline, answering one call at a time.

A process worker pushes batches into its arena as fast as its slots allow; a Ray actor is
pulled instead. The parent (aioloader/workers/_ray.py) keeps at most ``slots`` calls in flight per
actor, and each call returns one reply: a batch built where the actor runs, a pass end, a
hand-over (recycling) or the worker's exception. The calls in flight are the backpressure:
no batch is built that nobody asked for.

The parent numbers its calls to each actor, and the actor serves them in that order, one
at a time. Ray does not do it for us: calls submitted in order from one thread to a plain
actor (``max_concurrency=1``) ran out of order here (Ray 2.60, calls queued while the
actor was busy: a worker's random draws went to the wrong batches). So the actor is an
async one; a call waits for its turn on Ray's loop, and its work runs in one thread of the
actor's own (every call of the user's code in the same thread).

The pipeline is the process worker's (``WorkerSpec.pipeline()``: source → loads → batcher
→ collate), with its worker info, seeds, ``worker_init_fn``, shard and resume position.
Its async parts (an async reader, a load stage) run on an event loop the actor owns for its
lifetime, in a thread of its own (Ray's loop runs the calls' turns; ``run_until_complete``
there raised "Cannot run the event loop while another loop is running"), which also keeps a
load stage's window going between two calls. This module imports no Ray at import time: ``_ray.py``
wraps :class:`RayWorker` with ``ray.remote`` when it starts one.

Tensors travel as raw bytes beside the pickle (:func:`tensor_out`), not inside it: torch's
own pickling copies each tensor into the pickle stream and out again (9 ms of the
consumer's CPU per 9.6 MB image batch, measured), where Ray carries a NumPy buffer out of
band, written once into the object store and mapped by the consumer (1.6 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .._info import WorkerInfo, set_worker_info
from ..pipeline._loads import ALL_SKIPPED, LoadStage, SkippedLoad
from ..pipeline._pipeline import Boundary, Pipeline, each
from ..plane._codec import tensors_nbytes
from ..plans._position import ShardPosition
from ._worker import WorkerSpec, own_memory, pickled_error, seed_everything, traceback_text

T = TypeVar("T")


async def _next(it: AsyncIterator[T]) -> T:
    return await anext(it)


@dataclass(frozen=True, slots=True)
class Built:
    """A batch (or a chunk of instances, or None when every key of it was skipped)."""

    seq: int
    mark: Any
    value: Any
    nbytes: int
    busy: float  # seconds the actor spent in calls so far (telemetry)
    retire: bool = False  # index batches: this worker is due for recycling after this one
    skipped: tuple[SkippedLoad, ...] = ()  # keys skipped on error since the last reply


@dataclass(frozen=True, slots=True)
class PassOver:
    pass_no: int
    batches: int
    busy: float
    skipped: tuple[SkippedLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Retire:
    """A stream's worker is due for recycling: its successor starts at ``position``."""

    position: ShardPosition
    skipped: tuple[SkippedLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Raised:
    """The worker's exception: its repr, its traceback, itself when it pickles."""

    error_repr: str
    traceback: str
    pickled: bytes | None


Reply = Built | PassOver | Retire | Raised


@dataclass(frozen=True, slots=True)
class Hello:
    """Where the actor runs: the parent's stats and error messages name it."""

    node: str
    host: str
    pid: int


def _carry_tensors_out_of_band() -> None:
    """Every plain CPU tensor this process sends through Ray goes as :func:`tensor_out`
    says (the process is the actor's: nothing else of the user's is serialized here)."""
    from ray.util import register_serializer

    register_serializer(torch.Tensor, serializer=tensor_out, deserializer=tensor_in)


def tensor_out(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor as Ray sends it: its bytes as a uint8 NumPy array (out of band: written
    once into the object store, mapped where it is read), its dtype and shape. Anything but
    a plain dense CPU tensor is pickled as torch pickles it."""
    if not (t.is_cpu and t.layout == torch.strided and not t.is_quantized
            and not t.is_nested and not t.is_conj() and not t.is_neg()):
        return ("pickle", pickle.dumps(t))
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return ("raw", flat.numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape),
            t.requires_grad)


def tensor_in(data: tuple[Any, ...]) -> torch.Tensor:
    """The tensor of :func:`tensor_out`, in the consumer: a view of the object store's
    buffer (the buffer stays as long as the tensor does)."""
    if data[0] == "pickle":
        loaded: torch.Tensor = pickle.loads(data[1])
        return loaded
    _, raw, dtype, shape, grad = data
    with warnings.catch_warnings():
        # Ray hands a read-only array over a buffer that is the consumer's alone (its
        # object is taken once, by one consumer): torch's warning about it does not apply.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(raw)
    t = t.view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_() if grad else t


def _raised(exc: BaseException) -> Raised:
    return Raised(repr(exc), traceback_text(exc), pickled_error(exc))


@dataclass
class _Retirement:
    """Recycling (``max_batches_per_worker``, ``max_worker_rss``), decided here as a
    process worker decides it: the batches built, and this process's own memory."""

    max_batches: int | None
    max_rss: int | None
    batches: int = 0

    def batch_done(self) -> bool:
        self.batches += 1
        if self.max_batches is not None and self.batches >= self.max_batches:
            return True
        return self.max_rss is not None and own_memory() > self.max_rss


@dataclass
class _Clock:
    """The share of its life the actor spent answering calls (``stats().workers[k].busy``)."""

    born: float = field(default_factory=time.monotonic)
    busy: float = 0.0


class RayWorker:
    """Worker ``worker_id`` of ``spec``, starting at ``start`` (a stream's position after a
    restart or a recycle; None: where the spec says)."""

    def __init__(self, spec: WorkerSpec, worker_id: int,
                 start: ShardPosition | None = None) -> None:
        spec = spec.for_worker(worker_id)
        if start is not None:
            spec = spec.starting_at(start, spec.workers.num_workers)
        self.spec = spec
        self.clock = _Clock()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="aioloader-ray-worker",
                         daemon=True).start()  # the actor's process ends with the actor
        self.work = ThreadPoolExecutor(1, thread_name_prefix="aioloader-ray-call")
        self.turns: asyncio.Condition | None = None  # on Ray's loop, made by the first call
        self.turn = 0  # the number of the call whose turn it is
        self.begun = 0  # index calls whose loads have started (they start in call order)
        self.skipped: list[SkippedLoad] = []
        self.failure: Raised | None = None
        self.stack = contextlib.AsyncExitStack()
        self.stage: LoadStage | None = None
        self.pipe: Pipeline = spec.pipeline()
        self.retirement = _Retirement(spec.workers.max_batches, spec.workers.max_rss)
        self.replies: AsyncIterator[Reply] | None = None
        self.last: Reply | None = None  # a stream that ended answers with its last word
        _carry_tensors_out_of_band()
        info = WorkerInfo(spec.workers.num_workers, worker_id, spec.seed_for(spec.first_pass),
                          spec.rank, spec.world_size)
        set_worker_info(info, dataset=spec.source)
        seed_everything(info.seed)
        try:
            if spec.workers.init_fn is not None:
                spec.workers.init_fn(worker_id)  # as torch: after seeds and worker info
            self._run(self._enter_stage())
        except Exception as exc:  # noqa: BLE001 - the first call answers with it
            self.failure = _raised(exc)

    async def _enter_stage(self) -> None:
        async def report(s: SkippedLoad) -> None:
            self.skipped.append(s)

        made = self.pipe.stage(self.spec.worker_id, report=report)
        if made is not None:
            self.stage = await self.stack.enter_async_context(made)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _in_turn(self, call: int, work: Callable[..., Reply], *args: Any) -> Reply:
        """Run ``work(*args)`` in the work thread once calls ``0 .. call - 1`` are done."""
        if self.turns is None:
            self.turns = asyncio.Condition()
        async with self.turns:
            await self.turns.wait_for(lambda: self.turn == call)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.work, work, *args)
        finally:
            async with self.turns:
                self.turn += 1
                self.turns.notify_all()

    async def hello(self) -> Hello:
        import ray

        return Hello(ray.get_runtime_context().get_node_id(), socket.gethostname(),
                     os.getpid())

    def _taken_skips(self) -> tuple[SkippedLoad, ...]:
        out, self.skipped = tuple(self.skipped), []
        return out

    # ------------------------------------------------------------------ index batches

    async def fetch(self, call: int, seq: int, indices: list[int]) -> Reply:
        """Map-style batch ``seq``: fetch ``indices`` and collate them (call ``call``).
        With a load stage, the batch's loads start as soon as the calls before it started
        theirs, not when its turn comes: loads overlap across the batches in flight (the
        parent's calls bound them, the stage's gate too), as in a process worker."""
        loading = await self._start_loads(call, indices) if self.stage is not None else None
        return await self._in_turn(call, self._fetch, seq, indices, loading)

    async def _start_loads(self, call: int, indices: list[int]) -> Future[list[Any]] | None:
        if self.turns is None:
            self.turns = asyncio.Condition()
        async with self.turns:
            await self.turns.wait_for(lambda: self.begun == call)
            self.begun += 1
            self.turns.notify_all()
        if self.failure is not None or self.stage is None:
            return None
        return asyncio.run_coroutine_threadsafe(self.stage.fetch(self.spec.source, indices),
                                                self.loop)

    def _fetch(self, seq: int, indices: list[int],
               loading: Future[list[Any]] | None = None) -> Reply:
        if self.failure is not None:
            return self.failure
        began = time.monotonic()
        try:
            items = loading.result() if loading is not None else self.pipe.fetch(indices)
            # Every key of the batch skipped: an empty answer, which the parent passes over.
            value = self.pipe.collate(items) if items or self.stage is None else None
            mark = None if value is not None or self.stage is None else ALL_SKIPPED
            retire = self.retirement.batch_done()
        except Exception as exc:  # noqa: BLE001 - the parent raises it as a WorkerError
            self.failure = _raised(exc)
            return self.failure
        finally:
            self.clock.busy += time.monotonic() - began
        return Built(seq, mark, value, tensors_nbytes(value), self.clock.busy, retire,
                     self._taken_skips())

    # ------------------------------------------------------------------ streams

    async def next(self, call: int) -> Reply:
        """A stream's next reply: a batch, a pass end, or the hand-over when recycling."""
        return await self._in_turn(call, self._next)

    def _next(self) -> Reply:
        if self.failure is not None:
            return self.failure
        if self.replies is None:
            self.replies = self._stream()
        began = time.monotonic()
        try:
            reply = self._run(_next(self.replies))
        except StopAsyncIteration:  # an instances pass or a hand-over said its last word
            assert self.last is not None
            return self.last
        except Exception as exc:  # noqa: BLE001 - the parent raises it as a WorkerError
            self.failure = _raised(exc)
            return self.failure
        finally:
            self.clock.busy += time.monotonic() - began
        self.last = reply
        return reply

    async def _stream(self) -> AsyncIterator[Reply]:
        """Passes over this worker's shard, as ``_worker._run_stream`` runs them."""
        spec, pipe, stage = self.spec, self.pipe, self.stage
        start = spec.start()
        pass_no = start.pass_no
        seeded = spec.seed_for(spec.first_pass)  # in __init__, before worker_init_fn ran
        while True:
            seed = spec.seed_for(pass_no)
            set_worker_info(WorkerInfo(spec.workers.num_workers, spec.worker_id, seed,
                                       spec.rank, spec.world_size), dataset=spec.source)
            if seed != seeded:  # not again: worker_init_fn's seeding stays
                seed_everything(seed)
            seeded = -1
            sent = 0
            due = False
            if spec.plan == "instances":
                async with contextlib.aclosing(each(pipe.chunks(start.start, stage))) as it:
                    async for chunk in it:
                        yield Built(sent, None, chunk, 0, self.clock.busy,
                                    skipped=self._taken_skips())
                        sent += 1
                yield PassOver(pass_no, sent, self.clock.busy, self._taken_skips())
                return  # one pass only: later calls get that pass end again
            async with contextlib.aclosing(each(pipe.batches(start, seed, stage))) as steps:
                async for step in steps:
                    if isinstance(step, Boundary):
                        if due:  # retiring, at a block boundary: the successor starts here
                            yield Retire(ShardPosition(pass_no, step.start,
                                                       frontier=start.frontier),
                                         self._taken_skips())
                            return
                        continue
                    value = pipe.collate(step.items)
                    yield Built(sent, step.mark, value, tensors_nbytes(value),
                                self.clock.busy, skipped=self._taken_skips())
                    sent += 1
                    due = self.retirement.batch_done() or due
            yield PassOver(pass_no, sent, self.clock.busy, self._taken_skips())
            pass_no += 1
            start = ShardPosition(pass_no)
            if due:
                yield Retire(start, self._taken_skips())
                return
