"""Where collated tensors are written: a pluggable allocator, stacks into its memory, and
torch's own collate routed there."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

from .._info import Patch

__all__ = ["Allocator", "ConsumerWaits", "new_tensor", "stack", "use_allocator"]

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Returns an uninitialised, contiguous CPU tensor of the given shape and dtype."""

_allocator: ContextVar[Allocator | None] = ContextVar("aioloader_allocator", default=None)
_helper = threading.local()  # .executor: this thread's copy helper (a thread's, not a context's:
# the fetch thread runs each call in its caller's context, ``_local._InProcess.submit``)
SPLIT_BYTES = 4 << 20  # a stack into memory this large is shared with the helper
CHUNKS = 8  # in this many pieces: what this thread may wait for is one of them
SPARSE = {torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc}


class use_allocator:
    """Make `new_tensor` (and so every collated CPU tensor) come from `alloc` in this context.
    A class, not a generator: entered once a batch, a generator costs five calls more.

    Examples:
        with use_allocator(writer.alloc):
            batch = default_collate(samples)
    """

    __slots__ = ("_alloc", "_token")

    def __init__(self, alloc: Allocator | None) -> None:
        self._alloc = alloc

    def __enter__(self) -> None:
        self._token = _allocator.set(self._alloc)

    def __exit__(self, *exc: object) -> None:
        _allocator.reset(self._token)


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor from the current allocator, else from `torch.empty`."""
    alloc = _allocator.get()
    if alloc is None:
        return torch.empty(shape, dtype=dtype)
    return alloc(shape, dtype)


def stack(tensors: Sequence[Any]) -> torch.Tensor:
    """``torch.stack(tensors)``, into the current allocator's memory where it can (else
    into plain memory, and torch's own error where it cannot stack at all)."""
    elem = tensors[0]
    if _allocator.get() is not None and elem.device.type == "cpu" and _same_dtype(tensors):
        out = new_tensor((len(tensors), *elem.shape), elem.dtype)
        try:
            return _stack_into(tensors, out)
        except RuntimeError:
            pass  # autograd refuses `out=`, or the shapes differ: plain torch.stack decides
    return torch.stack(tensors, 0)  # type: ignore[arg-type]


@dataclass(slots=True)
class ConsumerWaits:
    """Whether the consumer waits for what this thread builds now: only then is the helper
    asked. Otherwise a chunk the idle-priority helper began waits for the consumer's step
    while this thread waits for the chunk (image batches ahead of a matmul step: 0.59x
    torch's ``num_workers=0`` with the helper, 0.78x without)."""

    now: bool


def copy_helper(executor: Executor | None, waiting: ConsumerWaits | None = None) -> None:
    """Let large stacks collated in this thread (one on one OpenMP thread: the fetch
    thread) share their copying with ``executor``'s (None: alone), while ``waiting`` says
    the consumer waits. A permuted image batch (a strided copy, 9.6 MB): 3.1-3.3 ms alone,
    2.0-2.4 ms shared (docs/architecture.md, "Batches built in this process")."""
    _helper.executor = executor
    _helper.waiting = waiting


def _stack_into(tensors: Sequence[Any], out: torch.Tensor) -> torch.Tensor:
    """``torch.stack(tensors, out=out)``; a large one in chunks that this thread and its
    helper (:func:`copy_helper`) take in turn, at once (torch lets go of the GIL while it
    copies). The helper runs at the lowest priority: whatever it has not started when this
    thread runs out of chunks, this thread copies, so at worst it waits for one chunk."""
    helper: Executor | None = getattr(_helper, "executor", None)
    waiting: ConsumerWaits | None = getattr(_helper, "waiting", None)
    if (helper is None or len(tensors) < 2 or out.nbytes < SPLIT_BYTES
            or (waiting is not None and not waiting.now)):
        return torch.stack(tensors, 0, out=out)  # type: ignore[arg-type]
    rows: list[torch.Tensor] = list(tensors)
    step = -(-len(rows) // CHUNKS)
    todo = iter(range(0, len(rows), step))  # shared: next() on it is atomic under the GIL
    job = [(rows, out)]  # emptied when done: an offer the helper never took stays in its queue
    # (cancelled, until its thread comes round to it) and must not keep the batch's memory

    def copy() -> None:
        for into_rows, into in job[:1]:
            for start in todo:
                torch.stack(into_rows[start:start + step], 0, out=into[start:start + step])

    theirs = helper.submit(copy)
    try:
        copy()
    finally:
        if not theirs.cancel():
            theirs.result()  # (its error, if any: the caller's plain torch.stack then decides)
        job.clear()
    return out


def stack_into_arena(batch: Sequence[torch.Tensor], *,
                     collate_fn_map: dict[Any, Callable[..., Any]] | None = None) -> torch.Tensor:
    """torch's ``collate_tensor_fn`` as our workers run it: stacked into the arena's slot
    (else plain memory). torch's own sees the worker info we set and stacks every batch into
    a new shared-memory segment: ~1,200 page faults per image batch, then a copy."""
    elem = batch[0]
    if elem.is_nested or elem.layout in SPARSE:  # torch's own errors
        raised: torch.Tensor = TORCH_COLLATE_TENSOR(batch, collate_fn_map=collate_fn_map)
        return raised
    return stack(batch)


TORCH_COLLATE_TENSOR = torch.utils.data._utils.collate.collate_tensor_fn


def route_torch_collate_into_arena() -> None:
    """In a worker process (ours): torch's ``default_collate`` stacks with
    :func:`stack_into_arena` for good (in this process, :data:`TORCH_COLLATE_IN_THREADS`)."""
    torch.utils.data._utils.collate.default_collate_fn_map[torch.Tensor] = stack_into_arena


def _torch_collate_without_segments() -> Callable[[], None]:
    collate_map = torch.utils.data._utils.collate.default_collate_fn_map
    if collate_map.get(torch.Tensor) is not TORCH_COLLATE_TENSOR:
        return lambda: None  # someone else's collate: theirs to keep
    collate_map[torch.Tensor] = stack_into_arena

    def undo() -> None:
        if collate_map.get(torch.Tensor) is stack_into_arena:
            collate_map[torch.Tensor] = TORCH_COLLATE_TENSOR

    return undo


# While thread workers exist, torch's default_collate does not put their batches in shared
# memory (as it does whenever get_worker_info() is set): stack_into_arena is a plain stack.
TORCH_COLLATE_IN_THREADS = Patch(_torch_collate_without_segments)


def _same_dtype(tensors: Sequence[Any]) -> bool:
    # torch.stack promotes mixed dtypes, while `out=` would silently cast float64 to float32.
    dtype = tensors[0].dtype
    try:
        for t in tensors:
            if t.dtype is not dtype:
                return False
    except AttributeError:
        return False  # not all tensors: let torch.stack name the culprit
    return True
