"""Asking Ray: connecting (on a thread that lasts), waiting for calls, where an actor ran.

What the Ray supervisor (aioloader/workers/_ray.py) needs of Ray beyond an actor's calls, each
done off the event loop where Ray blocks. Imports Ray only when called: ``import aioloader``
never needs it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import queue
import threading
from typing import Any, cast

from .._options import RAY_MISSING
from ._ray_actor import Hello, Reply

LOOKUP_WAIT = 5.0  # seconds a death's message waits for Ray to say where the actor ran

# connect()'s requests, served by the thread that starts Ray (_serve_init)
_init_requests: queue.SimpleQueue[concurrent.futures.Future[None]] = queue.SimpleQueue()
_init_thread: threading.Thread | None = None
_init_lock = threading.Lock()


def ray_module() -> Any:
    """``import ray``, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(RAY_MISSING) from exc
    return ray


async def connect() -> None:
    """``ray.init()`` unless the caller did: the caller's context when there is one
    (``ray.init(address=...)`` or ``RAY_ADDRESS``), else a local Ray. Seconds, so not on the
    loop; and on the thread that lives as long as the process (:func:`_serve_init`). A Ray
    the loader started stays up for the process, as a forkserver does: shutting it down
    would end any other Ray work of the process."""
    global _init_thread
    if ray_module().is_initialized():
        return
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    with _init_lock:
        if _init_thread is None or not _init_thread.is_alive():  # (none yet, or forked)
            _init_thread = threading.Thread(target=_serve_init, name="aioloader-ray-init",
                                            daemon=True)
            _init_thread.start()
        _init_requests.put(done)
    await asyncio.wrap_future(done)


def wait_and_drop(refs: list[Any], timeout: float) -> None:
    """Block until every ObjectRef of ``refs`` resolved (``timeout`` at most), raising
    nothing, then empty ``refs``.

    A close awaits this in a thread and the refs are dropped there: nothing may hold one
    once it returns. An awaited ref resolves from a callback on Ray's own thread, which
    still held the ref for a moment after the loop saw the result, and an executor's call
    holds its arguments a moment after its result is out: a close returned with its probes
    still owned (1-5 closes of 25 on the 2-core machine beside one busy process;
    tests/test_ray.py).
    """
    try:
        if refs:
            with contextlib.suppress(Exception):
                ray_module().wait(refs, num_returns=len(refs), timeout=timeout)
    finally:
        refs.clear()


async def first_reply(calls: collections.deque[Any]) -> Reply | BaseException:
    """The reply of the first call of ``calls`` (ObjectRefs), or Ray's error for it. The
    error is returned, not raised: its traceback would hold this frame, and the frame the
    ObjectRef, whose batch would then stay in the store as long as the error lives."""
    ref = calls[0]
    try:
        return cast("Reply", await ref)
    except ray_module().exceptions.RayError as exc:
        error: BaseException = exc
        return error
    finally:
        del ref


async def looked_up(handle: Any) -> Hello | None:
    """Where the actor of ``handle`` ran, as Ray's actor table says (for one that died
    before its Hello), asked off the loop; None where Ray does not know, or does not say
    within ``LOOKUP_WAIT``."""

    def where() -> Hello | None:  # blocking: GCS calls
        ray = ray_module()
        # (private: no public call of Ray 2.60 gives a dead actor's node and pid)
        info = ray._private.state.actors(actor_id=handle._actor_id.hex())
        node: str = info.get("Address", {}).get("NodeID", "")
        pid: int = info.get("Pid", 0)
        if not pid or not node.strip("f"):  # (never placed: no pid, a nil node ID)
            return None
        host = next((n.get("NodeManagerHostname", "?") for n in ray.nodes()
                     if n.get("NodeID") == node), "?")
        return Hello(node, host, pid)

    with contextlib.suppress(Exception):
        return await asyncio.wait_for(asyncio.to_thread(where), LOOKUP_WAIT)
    return None


def _serve_init() -> None:
    """``ray.init()`` for each :func:`connect` that asks, on a thread kept for the process's
    life.

    Ray starts its node's processes (GCS, raylet, agents) with PR_SET_PDEATHSIG, which
    fires when the *thread* that started them exits. Started from asyncio.to_thread, they
    died with that thread (at the sync face's close, at the end of asyncio.run): the next
    loader's Ray call ended the process, or hung, and agents orphaned by the killed raylet
    lingered for minutes after the program (issue 22 audit). A daemon, as the main thread
    would be: threading's shutdown joins executor threads *before* atexit runs Ray's own
    ``ray.shutdown()``, which stops those processes in order; this thread ends only with
    the process.
    """
    ray = ray_module()
    while True:
        done = _init_requests.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            if not ray.is_initialized():  # (another loader's start may have come first)
                ray.init(ignore_reinit_error=True, log_to_driver=True)
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise
            done.set_exception(exc)
        else:
            done.set_result(None)
