"""Running the loader's coroutines from synchronous code, inside a running loop or not."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ._loops import loop_factory

T = TypeVar("T")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Portal:
    """Runs coroutines to completion for synchronous callers, on loops kept between calls.

    Without a running loop in the calling thread (a plain script) the coroutine runs right
    there, on a loop of the portal's own. Inside a running loop (Jupyter, an async
    framework) it runs on a loop in a helper thread, since the caller's loop cannot be
    re-entered. Keeping the loops for the loader's lifetime lets a pass that spans sync
    epochs keep what its reader bound to a loop (aiofiles files, for one).
    """

    def __init__(self) -> None:
        self._runner: asyncio.Runner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if _running_loop() is None:
            with self._lock:
                if self._runner is None:
                    self._runner = asyncio.Runner(loop_factory=loop_factory())
            # Runner.run turns Ctrl-C into a cancellation of the coroutine, then re-raises;
            # but a Ctrl-C that lands before its handler is installed leaves the task behind.
            try:
                return self._runner.run(coro)
            except BaseException:
                self._cancel_leftovers(self._runner.get_loop())
                raise
        fut = asyncio.run_coroutine_threadsafe(coro, self._thread_loop())
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt here: stop the coroutine there, then go on
            concurrent.futures.wait([fut])
            raise

    @staticmethod
    def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    def usable_here(self) -> bool:
        """Whether :meth:`call` can run here now (not from inside the portal's own loop)."""
        return _running_loop() is None or _running_loop() is not self._loop

    def _thread_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
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
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Close both loops. Safe from any thread, and from the garbage collector."""
        with self._lock:
            runner, self._runner = self._runner, None
            loop, self._loop = self._loop, None
            thread, self._thread = self._thread, None
        if runner is not None:
            if _running_loop() is None:
                runner.close()
            else:  # another loop runs in this thread: it cannot drive ours to shut down
                runner.get_loop().close()
        if loop is not None and thread is not None:
            async def shutdown() -> None:
                await loop.shutdown_asyncgens()

            if thread is not threading.current_thread():
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result()
                loop.call_soon_threadsafe(loop.stop)
                thread.join()
                loop.close()
            else:
                loop.call_soon(loop.stop)


def run_blocking(portal: Portal, make: Callable[[], Awaitable[T]]) -> T:
    """Run one coroutine from synchronous code."""

    async def main() -> T:
        return await make()

    return portal.call(main())
