"""Running the loader's coroutines from synchronous code, inside a running loop or not."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from ._loops import loop_factory

T = TypeVar("T")
Call = Callable[[Coroutine[Any, Any, T]], T]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@contextlib.contextmanager
def portal() -> Iterator[Call[Any]]:
    """A function that runs a coroutine to completion and returns its result.

    Without a running loop in this thread (a plain script) the coroutines run right here, on
    a loop of our own. Inside a running loop (Jupyter, an async framework) they run on a
    loop in a helper thread, since this thread's loop cannot be re-entered.
    """
    if _running_loop() is None:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            yield runner.run
        return
    loop = loop_factory()()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=serve, name="aioloader-portal", daemon=True)
    thread.start()
    ready.wait()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt here: stop the coroutine there, then go on
            concurrent.futures.wait([fut])
            raise

    try:
        yield call
    finally:
        async def shutdown() -> None:
            await loop.shutdown_asyncgens()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def run_blocking(make: Callable[[], Awaitable[T]]) -> T:
    """Run one coroutine from synchronous code (see :func:`portal`)."""

    async def main() -> T:
        return await make()

    with portal() as call:
        result: T = call(main())
        return result
