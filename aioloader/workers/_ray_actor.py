"""The Ray actor of ``worker_type="ray"``: one worker's pipeline, answering one call at a time.

Pulled, its numbered calls served in order (docs/architecture.md, "Ray workers"): calls
submitted in order to a plain actor (``max_concurrency=1``) ran out of order when they
queued (Ray 2.60: a worker's random draws went to the wrong batches), so the actor is an
async one whose calls wait for their turn on Ray's loop, their work in a thread of its own.
A batch is built as a process worker builds it (``_passes.answer`` and ``build``), on an
event loop the actor owns in another thread, with its async parts (an async reader, a load
stage): ``run_until_complete`` on Ray's loop raised "Cannot run the event loop while another
loop is running"; that loop also keeps a load stage's window going between calls. Imports no
Ray at import time.

Tensors travel as raw bytes beside the pickle (:func:`tensor_out`): torch's pickling copies
each tensor into the pickle stream and out again (9 ms of the consumer's CPU per 9.6 MB
image batch, measured), where Ray writes a NumPy buffer once into the object store and the
consumer maps it (1.6 ms).
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
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ..pipeline._loads import SkippedLoad
from ..plane import _wire as wire
from ..plane._codec import tensors_nbytes
from ..plans._position import ShardPosition
from ..plans._sources import aclose
from ._failures import described
from ._passes import Build, PassEnd, Serving, answer, build, serving
from ._spec import WorkerSpec

T = TypeVar("T")


async def _next(it: AsyncIterator[T]) -> T:
    return await anext(it)


# ``busy``: seconds the actor spent in calls so far, this one's included (telemetry);
# ``skipped``: keys skipped on error since the last reply. Both set as a call ends.

@dataclass(frozen=True, slots=True)
class Built:
    """A batch (or a chunk of instances, or None when every key of it was skipped)."""

    seq: int
    mark: Any
    value: Any
    nbytes: int
    busy: float = 0.0
    retire: bool = False  # index batches: this worker is due for recycling after this one
    skipped: tuple[SkippedLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class PassOver:
    pass_no: int
    batches: int
    busy: float = 0.0
    skipped: tuple[SkippedLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Retire:
    """A stream's worker is due for recycling: its successor starts at ``position``."""

    position: ShardPosition
    busy: float = 0.0
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


class _Replying:
    """The :class:`~aioloader.workers._passes.Outlet` of one call: its batch, built, is the
    call's reply."""

    reply: Built | wire.BatchFailed

    async def emit(self, seq: int, make: Callable[[], Any], mark: Any) -> bool:
        value = make()
        self.reply = Built(seq, mark, value, tensors_nbytes(value))
        return True

    async def failed(self, seq: int, exc: Exception, mark: Any) -> bool:
        self.reply = wire.BatchFailed(seq, *described(exc, None), None, mark)
        return True

    async def retire(self) -> None:
        assert isinstance(self.reply, Built)
        self.reply = replace(self.reply, retire=True)


class RayWorker:
    """Worker ``worker_id`` of ``spec``, starting at ``start`` (a stream's position after a
    restart or a recycle; None: where the spec says)."""

    def __init__(self, spec: WorkerSpec, worker_id: int,
                 start: ShardPosition | None = None) -> None:
        spec = spec.for_worker(worker_id)
        if start is not None:
            spec = spec.starting_at(start)
        self.spec = spec
        self.busy = 0.0  # seconds spent answering calls (``stats().workers[k].busy``)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="aioloader-ray-worker",
                         daemon=True).start()  # the actor's process ends with the actor
        self.work = ThreadPoolExecutor(1, thread_name_prefix="aioloader-ray-call")
        self.turns = asyncio.Condition()  # bound to Ray's loop by the first call
        self.turn = 0  # the number of the call whose turn it is
        self.begun = 0  # index calls whose loads have started (they start in call order)
        self.skipped: list[SkippedLoad] = []
        self.failure: wire.Failed | None = None  # the worker's end: every later call's reply
        self.stack = contextlib.AsyncExitStack()  # the set-up's: left with the process
        self.serving: Serving | None = None
        self.replies: AsyncGenerator[Reply, None] | None = None
        self.last: Reply | None = None  # a stream that ended answers with its last word
        from ray.util import register_serializer  # every CPU tensor this actor sends

        register_serializer(torch.Tensor, serializer=tensor_out, deserializer=tensor_in)
        try:  # a process worker's set-up, on the actor's loop
            self.serving = self._run(self.stack.enter_async_context(
                serving(spec, self._report)))
        except Exception as exc:  # noqa: BLE001 - the first call answers with it
            self.failure = _raised(exc)

    async def _report(self, skipped: SkippedLoad) -> None:
        self.skipped.append(skipped)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _in_turn(self, call: int, work: Callable[..., Reply], *args: Any) -> Reply:
        """Run ``work(*args)`` in the work thread once calls ``0 .. call - 1`` are done
        (once the worker failed, its failure is every reply)."""
        async with self.turns:
            await self.turns.wait_for(lambda: self.turn == call)
        try:
            if self.failure is not None:
                return self.failure
            return await asyncio.get_running_loop().run_in_executor(self.work, work, *args)
        finally:
            async with self.turns:
                self.turn += 1
                self.turns.notify_all()

    def _timed(self, work: Callable[..., Reply], *args: Any) -> Reply:
        """``work(*args)``, its time counted as busy; its exception ends the worker."""
        began = time.monotonic()
        try:
            reply = work(*args)
        except Exception as exc:  # noqa: BLE001 - the parent raises it as a WorkerError
            self.failure = _raised(exc)
            return self.failure
        finally:
            self.busy += time.monotonic() - began
        if isinstance(reply, (Built, PassOver, Retire)):
            skipped, self.skipped = tuple(self.skipped), []
            reply = replace(reply, busy=self.busy, skipped=skipped)
        return reply

    async def hello(self) -> Hello:
        import ray

        return Hello(ray.get_runtime_context().get_node_id(), socket.gethostname(),
                     os.getpid())

    # ------------------------------------------------------------------ index batches

    async def fetch(self, call: int, seq: int, indices: list[int]) -> Reply:
        """Map-style batch ``seq``: fetch ``indices`` and collate them (call ``call``).
        With a load stage, the batch's loads start as soon as the calls before it started
        theirs, not when its turn comes: loads overlap across the batches in flight (the
        parent's calls bound them, the stage's gate too), as in a process worker."""
        loading: Future[list[Any]] | None = None
        stage = self.serving.stage if self.serving is not None else None
        if stage is not None:
            async with self.turns:
                await self.turns.wait_for(lambda: self.begun == call)
                self.begun += 1
                self.turns.notify_all()
            if self.failure is None:
                loading = asyncio.run_coroutine_threadsafe(
                    stage.fetch(self.spec.source, indices), self.loop)
        return await self._in_turn(call, self._timed, self._fetch, seq, indices, loading)

    def _fetch(self, seq: int, indices: list[int],
               loading: Future[list[Any]] | None = None) -> Reply:
        """Batch ``seq``, built (:func:`~aioloader.workers._passes.answer`), on the actor's
        loop as a process worker builds it."""
        assert self.serving is not None
        out = _Replying()
        loaded = loading.result() if loading is not None else None
        self._run(answer(self.serving, out, seq, indices, loaded))
        return out.reply

    # ------------------------------------------------------------------ streams

    async def next(self, call: int) -> Reply:
        """A stream's next reply: a batch, a pass end, or the hand-over when recycling."""
        return await self._in_turn(call, self._timed, self._next)

    def _next(self) -> Reply:
        if self.replies is None:
            self.replies = self._stream()
        try:
            self.last = self._run(_next(self.replies))
        except StopAsyncIteration:  # an instances pass or a hand-over said its last word
            assert self.last is not None
        return self.last

    async def rewind(self, call: int, pass_no: int) -> Reply:
        """Drop the stream's pass under way (the parent drops what the calls before this one
        bring) and answer ``Rewound``: the source's iterator is closed and called again for
        pass ``pass_no``, as torch's persistent worker does; the actor and its set-up stay."""
        return await self._in_turn(call, self._timed, self._rewind, pass_no)

    def _rewind(self, pass_no: int) -> Reply:
        if isinstance(self.last, Retire):  # handed over: its successor answers the rewind
            return self.last
        if self.replies is not None:
            self._run(aclose(self.replies))
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
                    out = _Replying()
                    await build(self.serving, out, event)
                    yield out.reply
                elif isinstance(event, PassEnd):
                    yield PassOver(event.pass_no, event.batches)
                else:
                    yield Retire(event.position)
