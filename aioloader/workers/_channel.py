"""A worker's end of its socket: the parent's commands in, framed messages out, arena slots.

A thread worker's batches go by reference, on a ``Shelf``."""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ..pipeline._recycle import MEMORY
from ..pipeline._stacking import use_allocator
from ..plane import _wire as wire
from ..plane._arena import ArenaMap, SlotFull, SlotWriter
from ..plane._codec import encode, tensors_nbytes
from ..plane._dataplane import RefPool, Shelf, SlotPool
from ..plans._position import Mark
from ._failures import described

PROGRESS_EVERY = 0.1  # seconds of reading without a message before a Progress is sent
_PROGRESS_FRAME = wire.encode(wire.Progress())


class Channel:
    """The :class:`~aioloader.workers._passes.Outlet` of a process (or thread) worker.
    ``stream``: its batches go unasked, each failed one in a slot too (an index batch's
    task bounds it)."""

    def __init__(self, slots: int, name: str, sock: socket.socket,
                 shelf: Shelf | None, *, stream: bool) -> None:
        self.slots = slots
        self.stream = stream
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.frames = wire.FrameReader()
        self.shelf = shelf
        self.pool = SlotPool(slots, name) if shelf is None else RefPool(slots, shelf)
        self.tasks: collections.deque[wire.Task] = collections.deque()
        self.rewind: int | None = None  # a stream's pass the parent asked to read again
        self.eof = False
        self.last_sent = self.started = time.monotonic()
        self.idle = 0.0  # seconds spent waiting for a slot or a task (telemetry: busy share)
        self._waiters: list[asyncio.Future[None]] = []  # a load stage has several
        self.on_eof: Callable[[], object] | None = None
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._on_readable)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.pool.close()

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
            self.loop.remove_reader(self.sock.fileno())
            if self.on_eof is not None:
                self.on_eof()
        else:
            for msg in self.frames.feed(data):
                if isinstance(msg, wire.Release):
                    self.pool.returned(msg.slot)
                elif isinstance(msg, wire.Task):
                    self.tasks.append(msg)
                elif isinstance(msg, wire.Rewind):
                    self.rewind = msg.pass_no
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def poll(self) -> None:
        """Read what the parent sent, now (one recv, no wait). A sync source lets the loop
        wait only once the slots are full, but a rewind must be seen before the next batch,
        or a retiring worker's successor would retire in the pass dropped."""
        if not self.eof:
            self._on_readable()

    async def _until(self, ready: Callable[[], bool]) -> bool:
        """Wait for ``ready()``; False when the parent went away first."""
        if ready():
            return True
        began = time.monotonic()
        try:
            while not ready():
                if self.eof:
                    return False
                fut = self.loop.create_future()
                self._waiters.append(fut)
                await fut
            return True
        finally:
            self.idle += time.monotonic() - began

    async def slot(self) -> int | None:
        """A free slot, reserved; None when the parent went away or asked for a rewind."""
        if not await self._until(lambda: bool(self.pool.free) or self.rewind is not None):
            return None
        return self.pool.reserve() if self.rewind is None else None

    async def closed(self) -> None:
        """Until the parent closes us (a worker that said its last word)."""
        await self._until(lambda: False)

    async def task(self) -> wire.Task | None:
        if not await self._until(lambda: bool(self.tasks)):
            return None
        return self.tasks.popleft()

    async def send(self, msg: wire.Message, fds: list[int] | None = None) -> None:
        frame = wire.encode(msg)
        self.last_sent = time.monotonic()
        if not fds:
            await self.loop.sock_sendall(self.sock, frame)
            return
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            try:
                sent = self.sock.sendmsg([frame], ancillary)
                break
            except (BlockingIOError, InterruptedError):
                await self._writable()
        if sent < len(frame):
            await self.loop.sock_sendall(self.sock, frame[sent:])

    def progress(self) -> None:
        """Say "still reading" when nothing went out for a while (the timeout's silence)."""
        now = time.monotonic()
        if now - self.last_sent < PROGRESS_EVERY:
            return
        self.last_sent = now
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            self.sock.send(_PROGRESS_FRAME)

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(fd, ready)
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)

    async def emit(self, seq: int, make: Callable[[], Any],
                   mark: Mark | str | None = None) -> bool:
        """Build one body in a free slot with ``make()`` (the collate allocates there), send it."""
        slot = await self.slot()
        if slot is None:
            return False
        try:
            return await self._fill(slot, seq, make, mark)
        except BaseException:
            self.pool.free.appendleft(slot)  # never published: it is still ours
            raise

    async def _fill(self, slot: int, seq: int, make: Callable[[], Any],
                    mark: Mark | str | None) -> bool:
        pool = self.pool
        if isinstance(pool, RefPool):  # a thread worker: the batch itself, by reference
            with use_allocator(MEMORY):  # memory that batches dropped before left warm
                payload = make()
            pool.put(slot, payload)
            busy = time.monotonic() - self.started - self.idle
            await self.send(wire.Batch(slot, seq, tensors_nbytes(payload), None, mark, busy))
            return True
        if pool.arena is None:
            with use_allocator(MEMORY):  # stacked as in a slot: contiguous, whatever the samples
                payload = make()  # the first batch tells how large a slot must be
            slot = await self._grow(tensors_nbytes(payload), slot)
            writer = SlotWriter(self._arena(), slot)
        else:
            if pool.kept:  # (SlotPool.returned)
                slot = await self._grow(pool.arena.slot_size, slot)
            writer = SlotWriter(self._arena(), slot)
            with use_allocator(writer.alloc):
                payload = make()
            if writer.overflow:
                slot = await self._grow(writer.pos - writer.start + writer.overflow, slot)
                writer = SlotWriter(self._arena(), slot)
        try:
            tree = encode(payload, writer)
        except SlotFull as full:
            slot = await self._grow(full.needed, slot)
            writer = SlotWriter(self._arena(), slot)
            tree = encode(payload, writer)
        del payload  # before the parent can give the slot back (SlotPool.returned)
        pool.published(slot, writer)
        nbytes = writer.pos - writer.start
        busy = time.monotonic() - self.started - self.idle
        await self.send(wire.Batch(slot, seq, nbytes, tree, mark, busy))
        return True

    async def failed(self, seq: int, exc: Exception, mark: Mark | str | None) -> bool:
        """Say that making batch ``seq`` raised ``exc``."""
        slot = await self.slot() if self.stream else None
        if self.stream and slot is None:
            return False
        await self.send(wire.BatchFailed(seq, *described(exc, self.shelf, seq), slot, mark))
        return True

    async def retire(self) -> None:
        """Say so: the parent gives our unanswered tasks to a successor, then closes us."""
        await self.send(wire.Retiring(None))
        await self.closed()

    def _arena(self) -> ArenaMap:
        assert self.pool.arena is not None
        return self.pool.arena

    async def _grow(self, needed: int, holding: int) -> int:
        """Make sure a slot holds ``needed`` bytes; the slot to write the batch in."""
        if self.pool.fits(needed):
            return holding
        grown = self.pool.grow(needed, holding)
        try:
            await self.send(wire.Arena(self.slots, grown.slot_size), fds=[grown.fd])
        finally:
            os.close(grown.fd)
        return grown.slot
