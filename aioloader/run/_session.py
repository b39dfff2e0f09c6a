"""Sessions: one lifecycle around whatever produces batches, in this process or in workers.

The states, and how a close or a timeout wakes the consumer at its one wait (inside
:meth:`Session.next`), are docs/architecture.md's "One lifecycle". A session outlives one
epoch (workers persist, a stream continues) and one event loop: it is attached to the loop
of the epoch running it.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from .._errors import LoaderClosedError, LoaderTimeoutError
from .._loops import running_loop
from .._stats import ArenaStats, WorkerStats
from ..workers._steps import Step

T = TypeVar("T")

GRACE = 1.0  # seconds a worker gets to exit on EOF before SIGTERM, then as long to SIGKILL


class Producer(Protocol):
    """What a session drives: started once, stepped, attached per epoch, closed once."""

    async def start(self) -> None: ...
    async def next(self) -> Step: ...
    def behind(self) -> str: ...
    def last_activity(self) -> float: ...
    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]: ...
    def attach(self, private: bool) -> None: ...
    def detach(self) -> None: ...
    def heal(self, silence: float) -> bool: ...
    async def aclose(self, grace: float) -> None: ...
    def close(self, grace: float) -> None: ...


@runtime_checkable
class Rewinds(Protocol):
    """A producer that can start a pass again without new workers: what was in flight is
    taken and dropped, so every worker's slots come back."""

    async def rewind(self, pass_no: int) -> None: ...


class State(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Session:
    """The lifecycle of one producer (see the module docstring)."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.state = State.STARTING
        self.owner_pid = os.getpid()
        self.loop: asyncio.AbstractEventLoop | None = None  # attached to, while an epoch runs
        self._lock = threading.Lock()
        self._consumer: asyncio.Task[Any] | None = None  # the task inside next(), if any
        self._reason: str | None = None  # why we cancelled it: "closed" or "timeout"
        self._timer: asyncio.TimerHandle | None = None
        self._closed = threading.Event()

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        """Start the producer; on any error or cancellation, close it (no grace)."""
        try:
            await self.producer.start()
        except BaseException:
            await self.aclose(0.0)
            raise
        with self._lock:
            if self.state is State.STARTING:
                self.state = State.IDLE

    def attach(self, private: bool = False) -> None:
        """Serve the running loop's epoch; ``private``: the loop is the sync adapter's."""
        loop = asyncio.get_running_loop()
        if self.loop is not None and self.loop is not loop:
            self.detach()  # an epoch left on another loop without closing (it was complete)
        self.loop = loop
        self.producer.attach(private)

    def detach(self) -> None:
        self.producer.detach()
        self.loop = None

    async def next(self, timeout: float | None = None) -> Step:
        """The next batch or pass end; ``timeout`` measures silence: nothing at all heard
        from the producer (a batch, an instance, a worker's progress) for that long."""
        return await self._step(self.producer.next, timeout)

    def rewinds(self) -> bool:
        """Whether the producer can start a pass again on the workers it has."""
        return isinstance(self.producer, Rewinds) and not self.closed

    async def rewind(self, pass_no: int, timeout: float | None = None) -> None:
        """Start pass ``pass_no`` from its beginning on the same workers (persistent
        workers after an epoch left early); waits, as :meth:`next` does, for what was in
        flight."""
        assert isinstance(self.producer, Rewinds)
        await self._step(functools.partial(self.producer.rewind, pass_no), timeout)

    async def _step(self, call: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        task = asyncio.current_task()
        assert task is not None and self.loop is not None
        with self._lock:
            if self.closed:
                raise LoaderClosedError("the loader was closed; iterate it again to restart")
            self.state = State.RUNNING
            self._consumer = task
        if timeout is not None:
            self._arm(timeout, time.monotonic())
        try:
            return await call()
        except asyncio.CancelledError:
            reason, self._reason = self._reason, None
            if reason is None or task.uncancel() > 0:
                raise  # a cancellation of the consumer's own (too)
            if reason == "timeout":
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {timeout} seconds: nothing arrived in that "
                    f"time; still waiting for "
                    f"{self.producer.behind()}. Raise timeout= if the source is just slow."
                ) from None
            raise LoaderClosedError(
                "the loader was closed (close()/aclose() from another task or thread) while "
                "this iteration waited for a batch") from None
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            with self._lock:
                self._consumer = None
                if self.state is State.RUNNING:
                    self.state = State.IDLE

    def _arm(self, timeout: float, since: float) -> None:
        assert self.loop is not None
        start = max(since, self.producer.last_activity())
        self._timer = self.loop.call_at(
            self.loop.time() + max(0.0, start + timeout - time.monotonic()),
            self._check_silence, timeout, since)

    def _check_silence(self, timeout: float, since: float) -> None:
        heard = max(since, self.producer.last_activity())
        if time.monotonic() - heard < timeout:
            self._arm(timeout, since)
            return
        if self.producer.heal(timeout):  # a hung worker was killed: wait for its successor
            self._arm(timeout, time.monotonic())
            return
        self._timer = None
        self._interrupt("timeout")

    def _interrupt(self, reason: str) -> None:
        """On the loop: end the consumer's wait inside next() (if it is waiting)."""
        consumer = self._consumer
        if consumer is not None and not consumer.done() and self._reason is None:
            self._reason = reason
            consumer.cancel()

    # ------------------------------------------------------------------ closing

    def _begin_close(self) -> bool:
        """Move to closing (once) and wake a consumer waiting in next()."""
        with self._lock:
            if self.closed:
                return False
            self.state = State.CLOSING
            consumer, loop = self._consumer, self.loop
        if consumer is not None and loop is not None and not loop.is_closed():
            if running_loop() is loop:
                self._interrupt("closed")
            else:
                loop.call_soon_threadsafe(self._interrupt, "closed")
        return True

    def _end_close(self) -> None:
        with self._lock:
            self.state = State.CLOSED
        self._closed.set()

    async def aclose(self, grace: float = GRACE) -> None:
        """Stop the producer (on the running loop); a second caller waits for the first."""
        if not self._begin_close():
            if not self._closed.is_set():
                await asyncio.to_thread(self._closed.wait)
            return
        try:
            await self.producer.aclose(grace)
        finally:
            self._end_close()

    def close(self, grace: float = GRACE) -> None:
        """Blocking close, for a thread whose loop does not serve this session right now."""
        if not self._begin_close():
            self._closed.wait()
            return
        try:
            self.producer.close(grace)
        finally:
            self._end_close()

    @property
    def closed(self) -> bool:
        return self.state in (State.CLOSING, State.CLOSED)

