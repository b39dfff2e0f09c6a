"""The Ray actor of ``worker_type="ray"``: one worker's pipeline, answering one call at a time.

A process worker pushes batches into its arena as fast as its slots allow; a Ray actor is
pulled instead. The parent (aioloader/workers/_ray.py) keeps at most ``slots`` calls in flight per
actor, and each call returns one reply: a batch built where the actor runs, a pass end, a
hand-over (recycling), a stream's failed batch (its error, and the stream goes on) or the
worker's exception; a ``rewind`` call answers ``Rewound`` once the stream starts its pass
again (persistent workers, an epoch left early), as a process worker answers ``Rewind``.
The calls in flight are the backpressure: no batch is built that nobody asked for.

The parent numbers its calls to each actor, and the actor serves them in that order, one
at a time. Ray does not do it for us: calls submitted in order from one thread to a plain
actor (``max_concurrency=1``) ran out of order here (Ray 2.60, calls queued while the
actor was busy: a worker's random draws went to the wrong batches). So the actor is an
async one; a call waits for its turn on Ray's loop, and its work runs in one thread of the
actor's own (a map-style batch's fetch and collate); a stream's passes, ``worker_init_fn``
and a load stage's loads run on the actor's own loop, in the loop's thread.

The set-up and the passes are the process worker's (``_passes.serving`` and
``_passes.passes``: worker info, seeds, ``worker_init_fn``, the pipeline and its load
stage; shard and resume position, recycling), turned into replies here.
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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..pipeline._loads import LoadStage, SkippedLoad
from ..pipeline._pipeline import Batch
from ..plane import _wire as wire
from ..plane._codec import tensors_nbytes
from ..plans._position import ShardPosition
from ..plans._sources import aclose
from ._failures import described
from ._passes import Build, PassEnd, Serving, serving
from ._spec import WorkerSpec

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


# The worker's exception, a stream's failed batch and a rewind's answer are a process's
# wire messages.
Reply = Built | PassOver | Retire | wire.Failed | wire.BatchFailed | wire.Rewound


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


def _raised(exc: BaseException) -> wire.Failed:
    return wire.Failed(*described(exc, None))


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
        self.failure: wire.Failed | None = None
        self.stack = contextlib.AsyncExitStack()  # the set-up's: left with the process
        self.serving: Serving | None = None
        self.stage: LoadStage | None = None
        self.replies: AsyncGenerator[Reply, None] | None = None
        self.last: Reply | None = None  # a stream that ended answers with its last word
        _carry_tensors_out_of_band()
        try:  # a process worker's set-up (``serve``), on the actor's loop
            self.serving = self._run(self.stack.enter_async_context(
                serving(spec, self._report)))
        except Exception as exc:  # noqa: BLE001 - the first call answers with it
            self.failure = _raised(exc)
        else:
            self.stage = self.serving.stage

    async def _report(self, skipped: SkippedLoad) -> None:
        self.skipped.append(skipped)

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
        """Batch ``seq``, built. Its dataset's or collate's error is that batch's and the
        next call's batch follows, as a process worker's (``_worker._run_index``) and
        torch's; with a load stage, it ends the worker, as it ends a process's."""
        if self.failure is not None:
            return self.failure
        assert self.serving is not None
        pipe = self.serving.pipe
        began = time.monotonic()
        try:
            items = loading.result() if loading is not None else pipe.fetch(indices)
            make, mark = self.serving.answering(items)
            value = make()
            retire = self.serving.retirement.batch_done()
        except Exception as exc:  # noqa: BLE001 - the parent raises it as a WorkerError
            if loading is None:  # that batch's: not counted for recycling, as a process's
                return wire.BatchFailed(seq, *described(exc, None))
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

    async def rewind(self, call: int, pass_no: int) -> Reply:
        """Drop the stream's pass under way and start pass ``pass_no`` from its beginning
        (call ``call``, in its turn after the calls made before it, whose batches the parent
        drops): :class:`~aioloader.plane._wire.Rewound`, as a process worker answers its
        ``Rewind``. The source's iterator is closed and ``iter(dataset)`` called again, as
        torch's persistent worker does for a new epoch; the actor and its set-up stay."""
        return await self._in_turn(call, self._rewind, pass_no)

    def _rewind(self, pass_no: int) -> Reply:
        if self.failure is not None:
            return self.failure
        if isinstance(self.last, Retire):  # handed over: its successor answers the rewind
            return self.last
        began = time.monotonic()
        try:
            if self.replies is not None:
                self._run(aclose(self.replies))
        except Exception as exc:  # noqa: BLE001 - the parent raises it as a WorkerError
            self.failure = _raised(exc)
            return self.failure
        finally:
            self.clock.busy += time.monotonic() - began
        self.replies = self._stream(ShardPosition(pass_no))
        return wire.Rewound(pass_no)

    async def _stream(self, start: ShardPosition | None = None) -> AsyncGenerator[Reply, None]:
        """The worker's passes (:func:`~aioloader.workers._passes.passes`) from ``start``
        (None: where the spec says) as replies; the stream ends after a hand-over, or after
        the one pass of instances."""
        assert self.serving is not None
        async with contextlib.aclosing(self.serving.passes(None, start)) as events:
            async for event in events:
                if isinstance(event, Build):
                    yield self._built(event)
                elif isinstance(event, PassEnd):
                    yield PassOver(event.pass_no, event.batches, self.clock.busy,
                                   self._taken_skips())
                else:
                    yield Retire(event.position, self._taken_skips())

    def _built(self, event: Build[Any]) -> Built | wire.BatchFailed:
        """A stream's batch (or chunk of instances), built. A batch whose making raised
        (the source's error, or the collate's) is that batch's error, and the stream goes
        on, as a process worker's (``_worker._emit_built``) and torch's (issue 32); a chunk
        of instances has no batch to fail: its error ends the worker."""
        assert self.serving is not None
        make, mark = self.serving.making(event.batch)
        if not isinstance(event.batch, Batch):
            return Built(event.seq, mark, make(), 0, self.clock.busy,
                         skipped=self._taken_skips())
        try:
            value = make()
        except Exception as exc:  # noqa: BLE001 - that batch's error; the stream goes on
            return wire.BatchFailed(event.seq, *described(exc, None), None, mark)
        return Built(event.seq, mark, value, tensors_nbytes(value), self.clock.busy,
                     skipped=self._taken_skips())
