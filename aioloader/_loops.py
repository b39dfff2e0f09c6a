"""Which event loop to run (uvloop when it is installed, else asyncio's default), and which
one runs this thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _preferred() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


# Chosen once, as aioloader is imported: a worker forked while another thread of the parent
# was importing uvloop (its first loader, say) inherits that import's module lock held, and
# an import of uvloop in the worker then waited for it forever (seen with two threads each
# starting loaders).
_FACTORY = _preferred()


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    return _FACTORY


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh loop of the preferred kind."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
