"""The shared-memory arena: one anonymous file per worker, cut into fixed-size slots.

``memfd_create`` where there is one: anonymous, so nothing leaks even after ``kill -9``, and
independent of the size of /dev/shm (docs/architecture.md, "The arena").
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ALIGN = 64  # cache-line alignment of every tensor in a slot; also fine for any dtype view


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def round_slot_size(nbytes: int) -> int:
    """A slot size with room to spare: 25 % headroom, rounded up to 64 KiB."""
    chunk = 64 * 1024
    return max(chunk, (nbytes + nbytes // 4 + chunk - 1) // chunk * chunk)


def create_file(size: int, name: str) -> int:
    """An anonymous shared-memory file of ``size`` bytes; the caller owns the fd."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:  # macOS and others: a file that is unlinked at once is just as anonymous
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=name, dir=shm)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _stored_at(storage: torch.UntypedStorage, offset: int, dtype: torch.dtype,
              shape: list[int]) -> torch.Tensor:
    """The tensor of ``dtype``/``shape`` stored contiguously at byte ``offset`` of
    ``storage`` (aligned)."""
    # set_ on the storage is about twice as fast as slicing and re-viewing the bytes.
    out: torch.Tensor = torch.empty(0, dtype=dtype).set_(
        storage, offset // dtype.itemsize, shape)  # type: ignore[call-overload]
    return out


class ArenaMap:
    """A mapping of an arena file: ``slots`` slots of ``slot_size`` bytes each."""

    def __init__(self, fd: int, slots: int, slot_size: int) -> None:
        self.slots = slots
        self.slot_size = slot_size
        # Not MAP_POPULATE: a slot faults its pages in (~3 us each) once, on its first batch;
        # populating the whole arena would make the first batch wait for every slot's, and
        # in the parent stall the event loop. No MADV_DONTFORK: tensors leased from here may
        # be part of what a worker forked later reads (a cache); it must see them.
        self._mm: mmap.mmap | None = mmap.mmap(fd, slots * slot_size, flags=mmap.MAP_SHARED)
        self.bytes: torch.Tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._storage = self.bytes.untyped_storage()
        self.base_ptr: int = self.bytes.data_ptr()

    def slot_range(self, slot: int) -> tuple[int, int]:
        """Byte range of ``slot`` (an id of any generation, ``_dataplane``)."""
        start = (slot % self.slots) * self.slot_size
        return start, start + self.slot_size

    def slot_array(self, slot: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """One numpy array over ``slot``'s bytes: tensors made from it keep it alive, and it is
        the only object whose death is observable (torch storages get new Python wrappers
        each time they are looked at)."""
        assert self._mm is not None
        start, _ = self.slot_range(slot)
        return np.frombuffer(self._mm, dtype=np.uint8, count=self.slot_size, offset=start)

    def view(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The tensor of ``dtype``/``shape`` stored contiguously at ``offset`` (aligned)."""
        return _stored_at(self._storage, offset, dtype, shape)

    def write(self, offset: int, data: bytes) -> None:
        assert self._mm is not None
        self._mm[offset:offset + len(data)] = data

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset``, copied out (the caller owns them)."""
        assert self._mm is not None
        return self._mm[offset:offset + n]

    def close(self) -> None:
        """Unmap; if a view is still alive somewhere, leave the unmapping to the GC."""
        mm, self._mm = self._mm, None
        del self.bytes, self._storage
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


class Lease:
    """Views of one slot for the consumer; ``on_free`` runs once none is left, in any thread.
    They share one numpy array over the slot, the only object whose death is observable
    (torch storages get new Python wrappers each time they are looked at)."""

    def __init__(self, arena: ArenaMap, slot: int, on_free: Callable[[], None]) -> None:
        assert arena._mm is not None
        self._mm = arena._mm  # bytes are read straight from the mapping (no view kept)
        self._start, _ = arena.slot_range(slot)
        self._base = arena.slot_array(slot)
        weakref.finalize(self._base, on_free)

    def __call__(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        rel = offset - self._start
        raw = torch.from_numpy(self._base[rel:rel + math.prod(shape) * dtype.itemsize])
        return raw.view(dtype).view(shape)

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset``, copied out (they hold no view of the slot)."""
        return self._mm[offset:offset + n]


class SlotFull(Exception):
    """The batch does not fit in one slot; ``needed`` bytes would."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"batch needs {needed} bytes")
        self.needed = needed


class SlotWriter:
    """A bump allocator over one slot of an arena (worker side)."""

    def __init__(self, arena: ArenaMap, slot: int) -> None:
        self.arena = arena
        self.slot = slot
        self.start, self.end = arena.slot_range(slot)
        self.pos = self.start
        self.overflow = 0  # bytes asked for that did not fit
        self.tensors: dict[int, int] = {}  # the encoder's: tensor id -> its place in the batch
        # What alloc hands out views one numpy array over the slot, so that the worker can
        # tell whether any outlived the batch (a collate_fn that keeps what it collated).
        self.handed_out: weakref.ref[object] | None = None
        self._slot_storage: torch.UntypedStorage | None = None

    def _take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` more of the slot (aligned), or None where they do not fit."""
        nbytes = align(nbytes)
        if self.pos + nbytes > self.end:
            return None
        off = self.pos
        self.pos += nbytes
        return off

    def _place(self, nbytes: int) -> int:
        off = self._take(nbytes)
        if off is None:
            raise SlotFull(align(nbytes))
        return off

    def alloc(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the slot; a plain one when the slot is full."""
        nbytes = math.prod(shape) * dtype.itemsize
        off = self._take(nbytes)
        if off is None:
            self.overflow += align(nbytes)
            return torch.empty(shape, dtype=dtype)
        if self._slot_storage is None:
            base = self.arena.slot_array(self.slot)
            self.handed_out = weakref.ref(base)
            self._slot_storage = torch.from_numpy(base).untyped_storage()
        return _stored_at(self._slot_storage, off - self.start, dtype, list(shape))

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t`` already lies in this slot (contiguous, whole), else None."""
        ptr = t.data_ptr() - self.arena.base_ptr
        if self.start <= ptr < self.end and t.is_contiguous():
            return ptr
        return None

    def place_bytes(self, data: bytes) -> int:
        """Copy ``data`` into the slot (one memcpy); its offset. Raises SlotFull."""
        off = self._place(len(data))
        self.arena.write(off, data)
        return off

    def place(self, t: torch.Tensor) -> int:
        """Copy ``t`` into the slot; its offset. Raises SlotFull."""
        off = self._place(t.nbytes)
        self.arena.view(off, t.dtype, list(t.shape)).copy_(t)
        return off
