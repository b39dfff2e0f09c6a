"""The data plane: who owns each arena slot, on both sides of a worker's socket.

A worker's :class:`SlotPool` reserves a slot, the collate and the encoder fill it, the
header publishes it; the parent's :class:`SlotLedger` accounts for it until it goes back
(unread -> leased or copied -> returned; docs/architecture.md, "The slot ledger"). Nothing
else counts slots. Slot ids run on across generations (generation g owns ids ``g * slots
...``), so a release can never be mistaken for a slot of another arena. A thread worker's
batch goes by reference (:class:`RefPool`, :class:`RefLedger`, a :class:`Shelf`), bounded
by the same slots.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._stats import ArenaStats
from ._arena import ArenaMap, Lease, SlotWriter, create_file, round_slot_size
from ._codec import Copied, decode

COPY_IN_THREAD_BYTES = 1 << 20  # a copy this large runs in a thread: the loop keeps going
LEASE_MIN_BYTES = 256 << 10  # below, a copy costs less than a lease's bookkeeping


# ---------------------------------------------------------------------- worker side

@dataclass(frozen=True, slots=True)
class Grown:
    """A new arena generation: announce ``fd`` (the caller closes it) before using ``slot``."""

    fd: int
    slot_size: int
    slot: int


class SlotPool:
    """A worker's slots. ``reserve`` a free one, fill it, publish it; the parent returns it."""

    def __init__(self, slots: int, name: str) -> None:
        self.slots = slots
        self.name = name
        self.free: collections.deque[int] = collections.deque(range(slots))
        self.generation = 0
        self.arena: ArenaMap | None = None
        self.handed_out: dict[int, weakref.ref[object]] = {}  # SlotWriter's, by published slot
        self.kept = False  # a slot came back while this worker still held tensors in it

    def published(self, slot: int, writer: SlotWriter) -> None:
        if writer.handed_out is not None:
            self.handed_out[slot] = writer.handed_out

    def returned(self, slot: int) -> None:
        """The parent gave ``slot`` back; a slot of a retired generation stays retired. If
        the collate_fn kept tensors it built there, the next batch goes to a new generation
        (this one stays mapped while they live): writing the slot would change them."""
        handed_out = self.handed_out.pop(slot, None)
        if slot // self.slots == self.generation:
            if handed_out is not None and handed_out() is not None:
                self.kept = True
            self.free.append(slot)

    def reserve(self) -> int:
        return self.free.popleft()

    def fits(self, needed: int) -> bool:
        return self.arena is not None and not self.kept and needed <= self.arena.slot_size

    def grow(self, needed: int, holding: int) -> Grown:
        """A larger arena (a new generation) for batches of ``needed`` bytes; ``holding``: the
        slot reserved for the batch that did not fit. The old arena's slots are not waited for."""
        size = round_slot_size(needed)
        fd = create_file(self.slots * size, self.name)
        try:
            new = ArenaMap(fd, self.slots, size)
        except BaseException:
            os.close(fd)
            raise
        if self.arena is not None:
            self.arena.close()
            self.generation += 1
            first = self.generation * self.slots
            self.free = collections.deque(range(first, first + self.slots))
            holding = self.free.popleft()
        self.arena = new
        self.kept = False
        self.handed_out.clear()
        return Grown(fd, size, holding)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class Shelf:
    """A thread worker's batches, by slot id, from publish until the parent takes them;
    and its exception, by reference, when it fails (nothing is pickled in-process)."""

    def __init__(self) -> None:
        self.items: dict[int, Any] = {}  # dict operations are atomic: two threads use it
        self.error: BaseException | None = None
        self.errors: dict[int, BaseException] = {}  # by batch: wire.BatchFailed's


class RefPool(SlotPool):
    """A thread worker's slots: no arena; a filled slot is its batch on the shelf."""

    def __init__(self, slots: int, shelf: Shelf) -> None:
        super().__init__(slots, "")
        self.shelf = shelf

    def put(self, slot: int, batch: Any) -> None:
        """Fill ``slot``; the header that publishes it is sent after (the socket orders
        this write before the parent's read)."""
        self.shelf.items[slot] = batch


# ---------------------------------------------------------------------- parent side

class SlotLedger:
    """The parent's account of one worker's slots; ``send_release(slot)`` frees one. Leases
    end in the GC, in any thread: their slots queue in ``_returned`` for the loop."""

    def __init__(self, slots: int, send_release: Callable[[int], None], *,
                 lease: bool = True) -> None:
        self.slots = slots
        self._send_release = send_release
        self._lease = lease
        self.arenas: dict[int, ArenaMap] = {}  # by generation
        self.generation = -1  # the newest
        self.leased = 0
        self._outstanding: collections.Counter[int] = collections.Counter()  # by generation
        self._returned: collections.deque[int] = collections.deque()  # any thread appends

    def add_arena(self, fd: int, slots: int, slot_size: int) -> None:
        """A new generation, mapped from ``fd`` (the caller closes it)."""
        self.generation += 1
        self.arenas[self.generation] = ArenaMap(fd, slots, slot_size)
        self._retire(self.generation - 1)

    def published(self, slot: int) -> None:
        """A message that holds ``slot`` arrived (a batch, or the end of a pass)."""
        self._outstanding[slot // self.slots] += 1

    async def take(self, slot: int, nbytes: int, tree: Any, *, lease: bool = True) -> Any:
        """The batch in ``slot``, the consumer's own: leased (views of the slot), or copied.

        One slot is never leased, so a consumer that hoards batches slows the loader down to
        copying but never stalls it. ``lease=False`` copies what is kept long (a cache).
        """
        self.reclaim()
        arena = self.arenas.get(slot // self.slots)
        if (lease and self._lease and arena is not None and nbytes >= LEASE_MIN_BYTES
                and self.leased < self.slots - 1):
            self.leased += 1
            views = Lease(arena, slot, functools.partial(self._returned.append, slot))
            batch = decode(tree, views)
            del views
            self.reclaim()  # a batch that kept no view of the slot (bytes) gives it back now
            return batch
        try:
            if nbytes >= COPY_IN_THREAD_BYTES:
                return await asyncio.to_thread(decode, tree, Copied(arena))
            return decode(tree, Copied(arena))
        finally:
            self.skip(slot)

    def skip(self, slot: int) -> None:
        """Give ``slot`` back (also for a message that needs no reading: a pass's end)."""
        generation = slot // self.slots
        self._outstanding[generation] -= 1
        self._send_release(slot)
        self._retire(generation)

    def reclaim(self) -> None:
        """Give back the slots whose leased batches were garbage-collected."""
        while self._returned:
            slot = self._returned.popleft()
            self.leased -= 1
            self.skip(slot)

    def _retire(self, generation: int) -> None:
        if generation < self.generation and self._outstanding[generation] <= 0:
            arena = self.arenas.pop(generation, None)
            if arena is not None:
                arena.close()

    def usage(self) -> ArenaStats:
        """Slots now: held by messages not yet taken (filled), leased, and the mapped bytes."""
        held = sum(list(self._outstanding.values()))
        nbytes = sum(a.slots * a.slot_size for a in list(self.arenas.values()))
        return ArenaStats(self.slots, self.slots - held, held - self.leased, self.leased,
                          nbytes)

    def close(self) -> None:
        """Unmap every arena; leased views keep their mapping until the last one goes."""
        for arena in self.arenas.values():
            arena.close()
        self.arenas.clear()


class RefLedger:
    """The parent's account of a thread worker's slots: a batch is taken off the shelf as
    it is (no copy, no lease: nothing else will write to it) and its slot goes back."""

    def __init__(self, slots: int, send_release: Callable[[int], None], shelf: Shelf) -> None:
        self.slots = slots
        self.shelf = shelf
        self._send_release = send_release
        self._held = 0

    def add_arena(self, fd: int, slots: int, slot_size: int) -> None:
        raise RuntimeError("a thread worker sent an arena: it has none")

    def published(self, slot: int) -> None:
        self._held += 1

    async def take(self, slot: int, nbytes: int, tree: Any, *, lease: bool = True) -> Any:
        try:
            return self.shelf.items.pop(slot)
        finally:
            self.skip(slot)

    def skip(self, slot: int) -> None:
        self._held -= 1
        self._send_release(slot)

    def reclaim(self) -> None:
        pass  # nothing is leased

    def usage(self) -> ArenaStats:
        return ArenaStats(self.slots, self.slots - self._held, self._held, 0, 0)

    def close(self) -> None:
        self.shelf.items.clear()  # batches never taken


Ledger = SlotLedger | RefLedger  # a worker's, whatever carries its batches
