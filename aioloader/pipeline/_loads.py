"""The load stage: cheap keys in (URLs, file names, row ids), loaded instances out, up to
``concurrency`` loads in flight per process (issue 11), in a worker as in the main process.

A load that raises is retried when the error is transient (``Retry``), then raises
:class:`~aioloader.LoadError`, or, with ``on_error="skip"``, becomes a :class:`SkippedLoad`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import ctypes
import errno
import functools
import inspect
import itertools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._errors import LoadError
from .._info import get_worker_info
from ..plans._sources import Kind, aclose
from ..plans._sources import fetch as fetch_items

log = logging.getLogger("aioloader")

OnError = Literal["raise", "skip"]
OwnLoad = Literal["loading", "load", "getitem"]  # which of the source's own is the load
ALL_SKIPPED = "all skipped"  # the mark of a map-style batch whose every key was skipped
DEFAULT_CONCURRENCY = 8
# So many keys failing one after the other is an outage, not bad keys: "skip" stops there.
MAX_CONSECUTIVE_FAILURES = 64
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}


@dataclass(frozen=True)
class Retry:
    """How a failed load is retried: up to ``retries`` more attempts per key, after a delay
    that doubles from ``backoff`` seconds up to ``max_backoff`` (with jitter).

    ``timeout``: seconds one attempt may take (None: no limit); a timed-out attempt counts as
    a transient failure. ``retry_on``: which errors are transient — a predicate or a tuple of
    exception types; by default connection resets, timeouts, truncated bodies and HTTP 5xx,
    429 and 408 (see :func:`is_transient`). A refused connection is not: nothing listens.

    Examples:
        >>> Retry(3).delay(1) <= 0.1
        True
    """

    retries: int = 3
    backoff: float = 0.1
    max_backoff: float = 5.0
    timeout: float | None = None
    retry_on: Callable[[BaseException], bool] | tuple[type[BaseException], ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or \
                self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"backoff and max_backoff must be >= 0, got {self.backoff!r} "
                             f"and {self.max_backoff!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be None or > 0 seconds, got {self.timeout!r}")

    def transient(self, exc: BaseException) -> bool:
        if self.retry_on is None:
            return is_transient(exc)
        if isinstance(self.retry_on, tuple):
            return isinstance(exc, self.retry_on)
        return bool(self.retry_on(exc))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): full jitter."""
        return random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: a reset or timed-out connection, a truncated body, or an HTTP
    status that says "later" (5xx, 429, 408), anywhere in the exception's chain."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError):
            return False  # nothing listens there: retrying only delays the error
        if isinstance(cur, (TimeoutError, ConnectionError)):
            return True
        if isinstance(cur, OSError) and cur.errno in _TRANSIENT_ERRNOS:
            return True
        status = _status(cur)
        if status is not None:
            return status >= 500 or status in (408, 429)
        module = type(cur).__module__
        if module.startswith("aiohttp") and type(cur).__name__ in (
                "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
                "ServerTimeoutError", "ContentLengthError"):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _status(exc: BaseException) -> int | None:
    """An HTTP status carried by the error: aiohttp's ``status``, botocore's response."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 100 <= status < 600:
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


@dataclass(frozen=True)
class SkippedLoad:
    """A key whose load failed with ``on_error="skip"``: which worker (None: the main
    process), after how many attempts, and the last error's repr."""

    key: Any
    worker: int | None
    attempts: int
    error: str


@dataclass(frozen=True)
class LoadOptions:
    """The loader's load-stage options, as data (pickled into each worker's spec).
    ``load_fn`` None: the source's own, ``own`` says which. ``keyed``: a map-style dataset's
    items are keys for ``load_fn`` (else its indices are its async ``__getitem__``'s keys)."""

    load_fn: Callable[[Any], Any] | None
    concurrency: int
    ordered: bool
    retry: Retry
    on_error: OnError
    keyed: bool = False
    own: OwnLoad | None = None


def load_options(source: Any, kind: Kind, *, load_fn: Callable[[Any], Any] | None,
                 concurrency: int | None, ordered: bool, retries: int | Retry,
                 on_error: str) -> LoadOptions | None:
    """The load stage the loader's arguments ask for; None when there is none. Raises
    ValueError for an option that needs a stage when there is none. Each argument's own
    type and range were checked before (aioloader/_options.py)."""
    retry = retries if isinstance(retries, Retry) else Retry(retries)
    own = own_load(source, kind) if load_fn is None else None
    if load_fn is None and own is None:
        given = [name for name, value, default in (
            ("concurrency", concurrency, None), ("ordered", ordered, True),
            ("retries", retries, 0), ("on_error", on_error, "raise")) if value != default]
        if given:
            raise ValueError(
                f"{', '.join(given)} configure the load stage, which this "
                f"{kind.value} does not have: pass load_fn= (an async or plain function "
                "key -> instance), or give the reader an async load(key) or a loading() "
                "context (a map-style dataset: an async __getitem__)")
        return None
    if concurrency is None:
        concurrency = DEFAULT_CONCURRENCY
    if not ordered and kind is Kind.MAP:
        raise ValueError("ordered=False applies to readers and IterableDatasets; a map-style "
                         "dataset's batches follow its sampler (loads overlap either way)")
    policy: OnError = "skip" if on_error == "skip" else "raise"
    return LoadOptions(load_fn, concurrency, ordered, retry, policy,
                       keyed=kind is Kind.MAP and load_fn is not None, own=own)


def own_load(source: Any, kind: Kind) -> OwnLoad | None:
    """Which load stage the source brings: ``loading()``, an ``async def load(key)``, or (a
    map-style dataset) an ``async def __getitem__``. Not a plain ``load`` method (a reader's
    may do something else): ``load_fn=reader.load`` says so."""
    if kind is Kind.MAP:
        coroutine = inspect.iscoroutinefunction(getattr(type(source), "__getitem__", None))
        return "getitem" if coroutine else None
    if callable(getattr(source, "loading", None)):
        return "loading"
    if inspect.iscoroutinefunction(getattr(source, "load", None)):
        return "load"
    return None


Report = Callable[[SkippedLoad], Awaitable[None] | None]

# Where the source being read reports what it left out itself: set by a worker for its run,
# and by the in-process producers around each step (``_local``).
SKIP_REPORT: contextvars.ContextVar[Report | None] = contextvars.ContextVar(
    "aioloader_skip_report", default=None)


async def report_skipped(key: Any, error: BaseException) -> None:
    """A source that leaves bad data out itself (a format reader's ``on_error="skip"``) says
    so here: counted and listed as a load stage's skips are (outside a loader: nothing)."""
    report = SKIP_REPORT.get()
    if report is None:
        return
    info = get_worker_info()
    reported = report(SkippedLoad(key, None if info is None else info.id, 1, repr(error)))
    if reported is not None:
        await reported


class LoadStage:
    """One process's load stage: ``async with LoadStage(...) as stage`` enters the source's
    ``loading()`` context (sessions, clients); leaving cancels the loads in flight, waits for
    them, and leaves it. A plain load function runs in a pool of ``concurrency`` threads."""

    def __init__(self, source: Any, options: LoadOptions, *, worker: int | None,
                 report: Report) -> None:
        self.source = source
        self.options = options
        self.worker = worker
        self._report = report
        self._gate = asyncio.Semaphore(options.concurrency)
        self._stack = contextlib.AsyncExitStack()
        self._call: Callable[[Any], Awaitable[Any]] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failures = 0  # in a row

    async def __aenter__(self) -> LoadStage:
        fn = self.options.load_fn
        own = self.options.own  # decided once, by load_options()
        if own == "loading":
            fn = await self._stack.enter_async_context(self.source.loading())
        elif own is not None:
            fn = getattr(self.source, "__getitem__" if own == "getitem" else "load")
        assert fn is not None
        self._call = self._wrap(fn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.cancel()
        finally:
            # Closed even when that wait is cancelled (the worker's EOF cancels its task):
            # left open, a reader's loading() was finalized by the loop's shutdown instead,
            # beside its inner generators ("athrow(): ... already running", issue 19).
            try:
                await self._stack.aclose()
            finally:
                self.abandon()  # the threads: a call still running in one ends on its own

    def _wrap(self, fn: Callable[[Any], Any]) -> Callable[[Any], Awaitable[Any]]:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                getattr(fn, "__call__", None)):  # noqa: B004 - an async callable object
            return fn
        loop = asyncio.get_running_loop()

        async def in_thread(key: Any) -> Any:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.options.concurrency, thread_name_prefix="aioloader-load",
                    initializer=ops_on_this_thread)
            result = await loop.run_in_executor(self._pool, fn, key)
            if inspect.isawaitable(result):  # a plain function that returned a coroutine
                return await result
            return result

        return in_thread

    def abandon(self) -> None:
        """No loop to wait on (a synchronous close): cancel the loads, drop the threads."""
        for task in list(self._tasks):
            task.cancel()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def cancel(self) -> None:
        """Cancel every load in flight and wait until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def load(self, key: Any) -> Any:
        """The instance of ``key`` (retried as the policy says), or a :class:`SkippedLoad`;
        :class:`LoadError` with "raise", and with "skip" after :data:`MAX_CONSECUTIVE_FAILURES`."""
        assert self._call is not None, "enter the stage first"
        retry = self.options.retry
        async with self._gate:
            for attempt in itertools.count(1):
                try:
                    if retry.timeout is None:  # not asyncio.timeout(None): 5 us a load
                        instance = await self._call(key)
                    else:
                        async with asyncio.timeout(retry.timeout):
                            instance = await self._call(key)
                except Exception as exc:  # noqa: BLE001 - classified, retried or reported
                    if attempt <= retry.retries and retry.transient(exc):
                        await asyncio.sleep(retry.delay(attempt))
                        continue
                    return await self._failed(key, attempt, exc)
                self._failures = 0
                return instance

    async def _failed(self, key: Any, attempts: int, exc: Exception) -> SkippedLoad:
        error = LoadError(key, self.worker, attempts, exc)
        if self.options.on_error == "raise":
            raise error from exc
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            raise LoadError(key, self.worker, attempts, exc,
                            note=f"{self._failures} loads failed in a row, so on_error='skip'"
                            " stopped: that is an outage or a wrong endpoint, not bad keys"
                            ) from exc
        skipped = SkippedLoad(key, self.worker, attempts, repr(exc))
        reported = self._report(skipped)
        if reported is not None:
            await reported
        return skipped

    def _start(self, key: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(self.load(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stream(self, keys: AsyncIterator[Any], *, ordered: bool | None = None,
                     tagged: bool = False) -> AsyncIterator[Any]:
        """Instances (or :class:`SkippedLoad` markers) of ``keys``, at most ``concurrency``
        ahead: in key order when ``ordered`` (None: as the options say), else as loads
        finish. ``tagged``: keys come as ``(tag, key)``, instances go as ``(tag, instance)``."""
        in_order = self.options.ordered if ordered is None else ordered
        started: dict[asyncio.Task[Any], Any] = {}  # the loads in flight, in key order: tags
        more = True
        try:
            while True:
                while more and len(started) < self.options.concurrency:
                    try:
                        key = await keys.__anext__()
                    except StopAsyncIteration:
                        more = False
                        break
                    tag, key = key if tagged else (None, key)
                    started[self._start(key)] = tag
                if not started:
                    return
                if in_order:
                    head = next(iter(started))
                    await head  # what the load raised, raised here
                    done = {head}
                else:
                    done, _ = await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    tag = started.pop(task)
                    yield (tag, task.result()) if tagged else task.result()
        finally:
            for task in started:
                task.cancel()
            if started:
                await asyncio.gather(*started, return_exceptions=True)
            await aclose(keys)  # the source's own iterator: its finally runs now

    async def fetch(self, dataset: Any, indices: Sequence[int]) -> list[Any]:
        """A map-style batch: the instances at ``indices`` (skipped ones left out), loaded
        concurrently; other batches' loads share the ``concurrency`` gate."""
        keys: Iterable[Any] = indices
        if self.options.keyed:
            keys = fetch_items(dataset, indices)  # the dataset's items are the keys
        tasks = [self._start(key) for key in keys]
        try:
            got = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return [x for x in got if not isinstance(x, SkippedLoad)]


class SkipLog:
    """A loader's skipped keys, across its sessions; each one logged as it comes."""

    def __init__(self) -> None:
        self.skipped: list[SkippedLoad] = []

    def add(self, skipped: SkippedLoad) -> None:
        self.skipped.append(skipped)
        where = "the main process" if skipped.worker is None else f"worker {skipped.worker}"
        log.warning("on_error='skip': skipped key %r in %s after %d attempt(s): %s "
                    "(%d skipped so far; loader.skipped lists them)", skipped.key, where,
                    skipped.attempts, skipped.error, len(self.skipped))


def ops_on_this_thread() -> None:
    """A helper thread's torch ops (a load thread's; the fetch thread's) run on that thread
    alone (issue 23). Not ``torch.set_num_threads``: it also stores the count for every
    thread that has run no parallel op yet (a main thread then trained on one thread after an
    epoch with a load stage). OpenMP's ``omp_set_num_threads`` is per thread, set after
    torch's lazy set-up of it (which would reset it). Without OpenMP nothing changes."""
    setter = _omp_set_num_threads()
    if setter is None:
        return
    torch.get_num_threads()  # torch sets this thread up now, not at its first op
    setter(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """The OpenMP runtime's ``omp_set_num_threads`` that torch loaded, if any."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        with contextlib.suppress(OSError, AttributeError):
            setter: Callable[[int], None] = ctypes.CDLL(path).omp_set_num_threads
            return setter
    return None
