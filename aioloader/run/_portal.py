"""Portal: an event loop kept for a loader's lifetime, running coroutines for plain code.

How it runs, and why not ``asyncio.Runner``, is docs/architecture.md's "sync adapter". Keeping
the loop lets a pass that spans sync epochs keep what its reader bound to it (aiofiles files).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from .._loops import loop_factory, running_loop

T = TypeVar("T")


# Loops a forked child inherited from its parent's portals. They are kept, never closed nor
# freed: freeing a uvloop loop there tears down libuv state it shares with the parent (the
# child aborts with "io_uring_enter: Bad file descriptor"; issue 9).
_INHERITED: list[Any] = []
_PORTALS: weakref.WeakSet[Portal] = weakref.WeakSet()


def _orphan_loops_in_child() -> None:
    for portal in list(_PORTALS):
        _INHERITED.append((portal.loop, portal._thread_loop))
        portal._reset()
    _PORTALS.clear()


os.register_at_fork(after_in_child=_orphan_loops_in_child)


async def _then_stop(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> T:
    """``coro``, then a stop of ``loop`` in the same turn: ``run_until_complete`` stops it
    from a callback of the task, one more turn of the loop (and of its selector) a call,
    and a call is a batch of the sync adapter."""
    try:
        return await coro
    finally:
        loop.stop()


def _let_frames_go(end: StopAsyncIteration) -> None:
    """An epoch's end, every epoch: its traceback runs through finished frames that hold
    the future or task that holds the exception (asyncio's and concurrent.futures' own
    among them). Their locals go now, or that cycle would keep the caller's frame, and the
    epoch's last batch in it, alive until the cyclic GC ran."""
    traceback.clear_frames(end.__traceback__)


class Portal:
    """Runs coroutines to completion for synchronous callers, on a loop kept between calls;
    a call from another thread while one drives is handed to the driver."""

    def __init__(self) -> None:
        self._reset()
        _PORTALS.add(self)

    def _reset(self) -> None:
        """No loop, no thread, no caller (also a forked child's, whose loops are kept)."""
        self.loop: asyncio.AbstractEventLoop | None = None  # driven by callers' threads
        self._thread_loop: asyncio.AbstractEventLoop | None = None  # for callers with a loop
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._driver: int | None = None
        self._handed: list[concurrent.futures.Future[Any]] = []
        self._in_flight = 0  # calls running on the thread loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` and return its result, from any thread."""
        here = running_loop()
        if here is not None:
            if here is self.loop:
                coro.close()
                raise RuntimeError("the sync adapter cannot be re-entered from its own loop")
            return self._call_in_thread(coro)
        with self._cond:
            if self._driver is not None and self.loop is not None:
                handed = asyncio.run_coroutine_threadsafe(coro, self.loop)
                self._handed.append(handed)
            else:
                handed = None
                self._driver = threading.get_ident()
        if handed is not None:
            return handed.result()
        try:
            return self._drive(coro)
        finally:
            self._let_go()

    def hand(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro``, from any thread, waiting for it only where this thread must drive
        the loop itself: one driven by another thread runs it before it lets go, a thread
        loop's runs it in its turn. For the garbage collector's backstops, which run in
        whatever thread collects: the one driving may be waiting for that very thread (a
        close waits for its reaping thread, whose collection finalized a dropped epoch that
        asked the driver to close it: neither wait ended)."""
        if running_loop() is not None:
            asyncio.run_coroutine_threadsafe(coro, self._ensure_thread_loop())
            return
        with self._cond:
            if self._driver is not None and self.loop is not None:
                self._handed.append(asyncio.run_coroutine_threadsafe(coro, self.loop))
                return
        self.call(coro)

    def _drive(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop is None:
            # asyncio's own loop, not uvloop: uvloop sets up its signal wake-up socketpair
            # every time it starts running in the main thread, and this loop starts once a
            # batch (26 us a batch against 54-99 us, measured on trivial batches).
            self.loop = asyncio.new_event_loop()
        loop = self.loop
        task = loop.create_task(_then_stop(coro, loop))
        try:
            loop.run_forever()  # until the task stops it: the turn that finishes it is the last
            if not task.done():  # something else stopped the loop
                return loop.run_until_complete(task)
            return task.result()
        except StopAsyncIteration as end:
            _let_frames_go(end)
            raise
        except BaseException:
            # Ctrl-C (or any exception raised from the loop itself) left the step running:
            # cancel it and let it unwind (its epoch stops its workers), then go on.
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(task)
            elif not task.cancelled():
                # Ctrl-C raised inside the step (num_workers=0 fetches in it): the task holds
                # what is raised here; marked retrieved, or its collection logs "Task
                # exception was never retrieved" with the whole traceback.
                task.exception()
            raise
        finally:
            del task  # this frame is in that traceback too

    def _let_go(self) -> None:
        """Run what other threads handed over while we drove, then release the loop."""
        while True:
            with self._cond:
                handed, self._handed = self._handed, []
                if not handed:
                    self._driver = None
                    self._cond.notify_all()
                    return
            assert self.loop is not None
            for fut in handed:
                with contextlib.suppress(BaseException):  # the caller gets it from fut
                    self.loop.run_until_complete(asyncio.wrap_future(fut, loop=self.loop))

    def _call_in_thread(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._cond:  # close() waits for calls in flight: it would stop their loop
            fut = asyncio.run_coroutine_threadsafe(coro, self._ensure_thread_loop())
            self._in_flight += 1
        try:
            return fut.result()
        except StopAsyncIteration as end:
            _let_frames_go(end)
            raise
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt here: stop the coroutine there, then go on
            concurrent.futures.wait([fut])
            raise
        finally:
            del fut  # this frame is in the traceback too
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _ensure_thread_loop(self) -> asyncio.AbstractEventLoop:
        with self._cond:
            if self._thread_loop is None:
                loop = loop_factory()()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=serve, name="aioloader-portal",
                                                daemon=True)
                self._thread.start()
                ready.wait()
                self._thread_loop = loop
            return self._thread_loop

    def close(self) -> None:
        """Close both loops. Safe from any thread, and from the garbage collector."""
        with self._cond:
            loop = None
            if self._driver is None:  # a driver keeps its loop; the GC closes it later
                loop, self.loop = self.loop, None
            if self._thread is not threading.current_thread():
                # A call on the thread loop (a consumer woken by this very close) finishes
                # first: stopping the loop under it would leave its caller waiting forever.
                self._cond.wait_for(lambda: self._in_flight == 0)
            tloop, self._thread_loop = self._thread_loop, None
            thread, self._thread = self._thread, None
        if loop is not None:
            if running_loop() is None:
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        if tloop is not None and thread is not None:
            if thread is threading.current_thread():
                tloop.call_soon(tloop.stop)
                return
            with contextlib.suppress(RuntimeError, concurrent.futures.CancelledError):
                asyncio.run_coroutine_threadsafe(tloop.shutdown_asyncgens(), tloop).result()
            tloop.call_soon_threadsafe(tloop.stop)
            thread.join()
            tloop.close()
