"""Moving batches to a CUDA device: a pinned staging ring, a side stream, events.

docs/architecture.md, "Moving batches to the GPU", says how and why (no batch is taken from
the epoch ahead of the consumer: the overlap comes from the CPU running ahead of the GPU).
The CUDA calls go through a small :class:`Backend`, so that the ordering is tested on
machines without a GPU (tests/test_staging.py).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, Protocol

import torch

from ._arena import align
from ._device import map_tensors, tensors

SLOTS = 2  # staging buffers: batch N fills one while batch N-1's copy may still read the other


class Backend(Protocol):
    """What the stager needs from an accelerator (:class:`CudaBackend`'s): streams with
    ``wait_event``, events with ``record``, ``query``, ``synchronize``; ``copy`` allocates
    and copies on ``stream``, unwaited; ``keep_for`` keeps memory until ``stream`` is done."""

    device: torch.device  # tensors already there pass through

    def side_stream(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def event(self) -> Any: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def copy(self, src: torch.Tensor, stream: Any) -> torch.Tensor: ...
    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaBackend:
    """The real backend: torch's CUDA streams, events, caching host allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # One side stream per device for the process, never one per epoch: the caching
        # allocator pools device blocks per stream, and blocks cached on a stream nobody
        # allocates on again are dead weight (huggingface/pytorch-image-models#2784).
        self._side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def side_stream(self) -> Any:
        return self._side

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def event(self) -> Any:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def pinned(self, nbytes: int) -> torch.Tensor:
        # torch's caching host allocator: a buffer a later epoch asks for again is reused,
        # not page-locked anew.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        # Allocated on the side stream too: the allocator then knows the block is busy
        # until the copy is done; keep_for() adds the consumer's stream.
        with torch.cuda.stream(stream):
            return src.to(self.device, non_blocking=True)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


_cuda_backend = functools.cache(CudaBackend)


def backend_for(device: torch.device) -> Backend:
    """The backend for ``device`` (tests replace this function with a fake one)."""
    if device.index is None:  # "cuda" and "cuda:0" share one backend, one side stream
        device = torch.device("cuda", torch.cuda.current_device())
    return _cuda_backend(device)


# The stream of the thread that will use the batch, when that is not the thread that stages
# it: the sync adapter's loop may run in a helper thread (Jupyter), and CUDA's current
# stream is per thread.
handing_to: contextvars.ContextVar[Any] = contextvars.ContextVar("aioloader_handing_to",
                                                                default=None)


def consumer_stream(device: torch.device | None) -> Any:
    """The calling thread's current stream on ``device`` if it is a CUDA one, else None."""
    if device is None or device.type != "cuda":
        return None
    return backend_for(device).current_stream()


@dataclasses.dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    event: Any = None  # recorded after the last copy that read ``buffer``


_ALLOCATED = [0]  # staging buffers allocated by every stager of this process


def ring_allocations() -> int:
    """How many staging buffers this process allocated (each is reused for many batches)."""
    return _ALLOCATED[0]


class Stager:
    """Stages batches through a ring of pinned buffers to one CUDA device (one epoch's)."""

    def __init__(self, device: torch.device, slots: int = SLOTS) -> None:
        self._backend = backend_for(device)
        self.device = self._backend.device
        self._stream = self._backend.side_stream()
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0

    def stage(self, batch: Any) -> Any:
        """``batch`` on the device, ready for the consumer's current stream. Synchronous on
        purpose: the only wait, for a staging buffer's last copy, is bounded by copy time
        (the side stream holds nothing else), never by the consumer's compute."""
        backend = self._backend
        # Aligned places in one buffer: any dtype can view its place.
        slot = self._claim(sum(align(t.nbytes) for t in tensors(batch)
                               if t.device != self.device and _stages(t)))
        buffer = slot.buffer
        consumer = handing_to.get()
        if consumer is None:
            consumer = backend.current_stream()
        moved: list[torch.Tensor] = []
        end = 0

        def move(t: torch.Tensor) -> torch.Tensor:
            nonlocal end
            if t.device == self.device:
                return t
            src = t
            if _stages(t):
                assert buffer is not None
                src = buffer[end:end + t.nbytes].view(t.dtype).view(t.shape)
                end += align(t.nbytes)
                with torch.no_grad():
                    src.copy_(t)  # this tensor's H2D copy then overlaps the next one's fill
            out = backend.copy(src, self._stream)
            moved.append(out)
            return out

        # Per-tensor device copies rather than views of one device buffer: each tensor the
        # consumer keeps (labels, say) then holds only its own memory, as with ``.to()``.
        result = map_tensors(batch, move)
        event = slot.event
        if event is None:
            event = slot.event = backend.event()
        event.record(self._stream)
        consumer.wait_event(event)
        for out in moved:
            backend.keep_for(out, consumer)
        return result

    def _claim(self, need: int) -> _Slot:
        """The next slot, its last copy finished, its buffer at least ``need`` bytes."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.event is not None and not slot.event.query():
            slot.event.synchronize()  # refilling earlier would corrupt a copy in flight
        capacity = 0 if slot.buffer is None else slot.buffer.numel()
        if need > capacity:
            slot.buffer = None  # its copies are done: the allocator may reuse it at once
            slot.buffer = self._backend.pinned(max(need, 2 * capacity))  # geometric growth
            _ALLOCATED[0] += 1
        return slot


def _stages(t: torch.Tensor) -> bool:
    """Dense CPU tensors go through the ring; others (sparse, quantized, on another device)
    are copied directly."""
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
