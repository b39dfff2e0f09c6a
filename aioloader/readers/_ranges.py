"""Byte ranges of one file, local or behind an fsspec URL, fetched ahead of the reader.

A format reader walks a file from an offset on (a tar shard from a sample's first header).
:class:`Ahead` keeps ``ahead`` ranged reads of ``chunk`` bytes in flight, so a remote
shard streams at the bandwidth and not at one round trip per chunk, in bounded memory
(``ahead x chunk`` bytes); the reader opens its next shards while it reads one, a chunk
requested for each. A failed read is retried when the error is transient (the load stage's own
:class:`~aioloader.Retry` rules), else raised naming the file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

from ..pipeline._loads import Retry
from ._files import open_read_only

Fetch = Callable[[int, int], Awaitable[bytes]]  # bytes [start, end) of the file
CHUNK = 4 << 20
AHEAD = 4


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


class Files(contextlib.AbstractAsyncContextManager["Files"]):
    """Opens files for ranged reads: local ones with ``os.pread`` in a thread; URLs through
    the fsspec reader's asynchronous filesystem (``FsspecReader``'s connection settings),
    entered in the running loop and closed at exit."""

    def __init__(self, storage_options: dict[str, Any]) -> None:
        self.storage_options = storage_options
        self._stack = contextlib.AsyncExitStack()
        self._fs: Any = None

    async def __aenter__(self) -> Files:
        self._lock = asyncio.Lock()  # two shards may open at once: one filesystem for both
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._fs = None
        await self._stack.aclose()

    async def _filesystem(self, url: str) -> Any:
        async with self._lock:
            if self._fs is None:
                from ._fsspec import Filesystem, protocol_of

                self._fs = await self._stack.enter_async_context(
                    Filesystem(protocol_of([url]), self.storage_options))
        return self._fs

    async def ahead(self, url: str, start: int, *, chunk: int, ahead: int,
                    retry: Retry) -> Ahead:
        """``url`` opened at ``start``, its first chunk already requested. A remote file's
        first chunk is asked for beside its size, so that opening a shard costs one round
        trip, not two (a store answers a range past the end with what there is)."""
        fetch, size_of, close = await self.open(url)
        source = Ahead(url, fetch, start, chunk=chunk, ahead=ahead, retry=retry, close=close)
        source.prime()  # the first chunk, whatever the size
        try:
            await source.sized(await size_of())
        except BaseException:
            await source.aclose()
            raise
        return source

    async def open(self, url: str) -> tuple[Fetch, Callable[[], Awaitable[int]],
                                            Callable[[], None]]:
        """(fetch, size, close) of ``url``: ``size()`` asks for its size."""
        if not is_remote(url):
            path = url.removeprefix("file://")
            fd = await open_read_only(path)

            async def pread(start: int, end: int) -> bytes:
                return await asyncio.to_thread(os.pread, fd, end - start, start)

            async def local_size() -> int:
                return os.fstat(fd).st_size

            return pread, local_size, lambda: os.close(fd)
        from ._fsspec import fs_path, transient

        fs = await self._filesystem(url)
        path = fs_path(fs, url)

        async def cat(start: int, end: int) -> bytes:
            try:
                return bytes(await fs._cat_file(path, start=start, end=end))
            except Exception as exc:
                translated = transient(exc, url)
                if translated is exc:
                    raise
                raise translated from exc

        async def remote_size() -> int:
            return int((await fs._info(path))["size"])

        return cat, remote_size, lambda: None


class Ahead:
    """The bytes of one file from ``start`` on, read ``ahead`` chunks in advance."""

    def __init__(self, url: str, fetch: Fetch, start: int, *, chunk: int = CHUNK,
                 ahead: int = AHEAD, retry: Retry | None = None,
                 close: Callable[[], None] | None = None) -> None:
        self.url = url
        self._close = close
        self.size: int | None = None  # until sized()
        self.offset = start  # of the next byte read() hands out
        self._fetch = fetch
        self._chunk = chunk
        self._ahead = max(1, ahead)
        self._retry = retry or Retry(3)
        self._requested = start
        self._tasks: collections.deque[asyncio.Task[bytes]] = collections.deque()
        self._buf = b""
        self._at = 0  # the next byte of _buf to hand out

    async def _attempts(self, start: int, end: int) -> bytes:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._fetch(start, end)
            except Exception as exc:
                if attempt > self._retry.retries or not self._retry.transient(exc):
                    raise
                await asyncio.sleep(self._retry.delay(attempt))

    def prime(self) -> None:
        """Request the first chunk now, before the size is known (the reader is still busy
        with the shard before)."""
        end = self._requested + self._chunk
        self._tasks.append(asyncio.ensure_future(self._attempts(self._requested, end)))
        self._requested = end

    async def sized(self, size: int) -> None:
        """The file's size, learnt after :meth:`prime`: the first chunk's answer holds what
        there was; none is owed where the read starts at the end. The next chunks are asked
        for when reading begins (a shard opened ahead holds one chunk)."""
        self.size = size
        if self.offset >= size:
            await self._drop()
        self._requested = min(self._requested, size)

    def _fill(self) -> None:
        assert self.size is not None, "sized() first"
        while len(self._tasks) < self._ahead and self._requested < self.size:
            end = min(self._requested + self._chunk, self.size)
            self._tasks.append(asyncio.ensure_future(self._attempts(self._requested, end)))
            self._requested = end

    async def read(self, n: int) -> bytes:
        """The next ``n`` bytes; fewer only at the end of the file."""
        parts: list[bytes] = []
        want = n
        while want:
            if self._at >= len(self._buf):
                self._fill()
                if not self._tasks:
                    break
                self._buf, self._at = await self._tasks.popleft(), 0
                self._fill()
                if not self._buf:
                    break
            piece = self._buf[self._at:self._at + want]
            self._at += len(piece)
            want -= len(piece)
            parts.append(piece)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.offset += len(data)
        return data

    async def _drop(self) -> None:
        """Cancel the reads in flight and wait for them."""
        tasks, self._tasks = list(self._tasks), collections.deque()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel the reads in flight, wait for them, close the file."""
        try:
            await self._drop()
        finally:
            close, self._close = self._close, None
            if close is not None:
                close()
