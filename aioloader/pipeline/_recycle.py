"""Reused memory for the large tensors that a ``num_workers=0`` loader collates (issue 23).

Fresh memory costs a page fault per 4 KiB page, and the fetch thread's glibc heap gave each
freed 9.6 MB batch back to the kernel (2,352 faults, 4.4 ms of a 5 ms fetch). A
:class:`Recycler` builds the next batches in the buffers of those the consumer dropped, as
a worker builds them in its arena (docs/architecture.md, "Batches built in this process").
Each large tensor gets a buffer of its own (saving one tensor saves just that one); the death
of its numpy view hands the buffer back, from whatever thread drops it.
"""

from __future__ import annotations

import math
import os
import threading
import weakref

import numpy as np
import torch

MIN_BYTES = 256 << 10  # smaller tensors: torch.empty (malloc's own free lists reuse them)
KEEP = 4  # free buffers kept: a batch or two of a few large tensors each
KEEP_BYTES = 64 << 20  # and their bytes, at most (glibc keeps up to that much heap too)
SLACK = 1.5  # a buffer serves a tensor this many times smaller at most
PAGE = 64 << 10  # new buffers are rounded up to this: a tensor kept pins at most that more


class Recycler:
    """An allocator (``aioloader.pipeline._stacking.Allocator``) over reused buffers."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._reset()
        # A forked child starts afresh: the parent's lock may have been held at the fork (by
        # a fetch thread), and its free buffers are the parent's to reuse. A hook, not a pid
        # compared on every call: that is a system call twice a batch.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_if_alive(me))

    def _reset(self) -> None:
        self._free: list[np.ndarray] = []
        self._held = 0  # bytes in _free
        # Buffers handed out, by the id of the weak reference that sees their view die. A
        # weakref with a callback, not weakref.finalize: that one costs 60-85 us a batch in
        # a process forked from a large one (the bench's runs), 5-9 us elsewhere.
        self._out: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}
        self._lock = threading.Lock()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        buffer = self._take(nbytes)
        if buffer is None:
            size = -(-nbytes // PAGE) * PAGE
            _comes_and_goes(size)
            buffer = torch.empty(size, dtype=torch.uint8).numpy()  # 64-byte aligned
        view = buffer[:nbytes]  # the tensor's storage holds this array; its death frees it
        seen = weakref.ref(view, self._dropped)
        self._out[id(seen)] = (seen, buffer)  # one dict operation: atomic, no lock
        return torch.from_numpy(view).view(dtype).view(shape)

    def _take(self, nbytes: int) -> np.ndarray | None:
        """The free buffer that last came back among those that hold ``nbytes`` without
        wasting most of it: the likeliest to be in the cache still."""
        with self._lock:
            free = self._free
            for at in range(len(free) - 1, -1, -1):
                if nbytes <= free[at].nbytes <= nbytes * SLACK + PAGE:
                    buffer = free.pop(at)
                    self._held -= buffer.nbytes
                    return buffer
            return None

    def _dropped(self, seen: weakref.ref[np.ndarray]) -> None:
        """A tensor's view died (in whatever thread dropped it): its buffer is free."""
        entry = self._out.pop(id(seen), None)
        if entry is None:  # handed out before a fork, in the parent
            return
        with self._lock:
            free = self._free
            free.append(entry[1])
            self._held += entry[1].nbytes
            while len(free) > KEEP or self._held > self.keep_bytes:
                self._held -= free.pop(0).nbytes  # the oldest: sizes drift with the data

    def held(self) -> int:
        """Bytes kept in free buffers (diagnostics and tests)."""
        with self._lock:
            return self._held


def _reset_if_alive(ref: weakref.ref[Recycler]) -> None:
    recycler = ref()
    if recycler is not None:
        recycler._reset()


# One for the process: loaders come and go (one built per call, per epoch), the warm memory
# stays, as glibc's heap would have kept it.
MEMORY = Recycler()


def _comes_and_goes(nbytes: int) -> None:
    """Let malloc see a block of ``nbytes`` freed, as it would see each batch without us:
    else it keeps too little heap, and a batch's samples fault in anew each batch (2,175
    faults, 4 ms of a 5 ms fetch; docs/architecture.md). A map and an unmap, no fault."""
    torch.empty(nbytes, dtype=torch.uint8)
