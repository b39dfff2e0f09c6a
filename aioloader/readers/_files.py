"""Data files for readers: paths and globs to a sorted file list; bytes read off the loop."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import zlib
from collections.abc import Iterable
from typing import Any

import aiofiles
from aiofiles.threadpool.binary import AsyncFileIO

CHUNK_SIZE = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
_GLOB_CHARS = frozenset("*?[")

PathSpec = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


def expand_paths(data_path: Any) -> list[str]:
    """The files that ``data_path`` names, sorted and without duplicates.

    ``data_path`` is a path, a glob pattern (``**`` matches any depth) or a list of those.
    A pattern that matches no file, or a path that does not exist, is a FileNotFoundError.

    Examples:
        >>> expand_paths([])
        Traceback (most recent call last):
        ...
        ValueError: data_path is an empty list: name at least one file or glob pattern
    """
    if isinstance(data_path, (str, os.PathLike)):
        entries: list[Any] = [data_path]
    elif isinstance(data_path, Iterable) and not isinstance(data_path, (bytes, bytearray)):
        entries = list(data_path)
    else:
        raise TypeError(f"data_path must be a path, a glob pattern or a list of them, "
                        f"got {type(data_path).__name__}")
    if not entries:
        raise ValueError("data_path is an empty list: name at least one file or glob pattern")
    files: set[str] = set()
    for entry in entries:
        files.update(_expand_one(entry))
    return sorted(files)


def _expand_one(entry: Any) -> list[str]:
    path = os.fspath(entry)
    if not isinstance(path, str):
        raise TypeError(f"paths must be str or os.PathLike[str], got {entry!r}")
    path = os.path.expanduser(path)
    if _GLOB_CHARS.isdisjoint(path):
        if os.path.isdir(path):
            raise IsADirectoryError(
                errno.EISDIR, "a directory, not a data file: pass a glob such as "
                f"{os.path.join(path, '*.jsonl')!r}", path)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "no such data file", path)
        return [os.path.normpath(path)]
    import glob

    matches = [os.path.normpath(m) for m in glob.glob(path, recursive=True)
               if os.path.isfile(m)]
    if not matches:
        raise FileNotFoundError(errno.ENOENT, "no file matches the glob pattern", path)
    return matches


class TruncatedGzipError(EOFError):
    """A gzip stream that ends before its end-of-stream marker."""


class ByteSource:
    """The bytes of one file in chunks, gunzipped when it is gzip (by suffix or magic bytes).

    Reads run in aiofiles' thread pool, so the event loop is never blocked on disk; gzip is
    inflated chunk by chunk (``max_length``), so memory stays bounded whatever the file or
    compression ratio. Plain coroutines and no async generators: a pass of a reader may be
    resumed on another event loop (the sync adapter runs one loop per epoch), and an async
    generator of ours would be finalised when the first loop shuts down.
    """

    def __init__(self, path: str, fd: int, chunk_size: int) -> None:
        self.path = path
        self.chunk_size = chunk_size
        self.gzip: bool | None = None  # decided on the first chunk
        self._fd = fd
        self._file: AsyncFileIO | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflate: Any = None  # the zlib decompressor of the current gzip member
        self._pending = b""  # compressed input not yet given to the decompressor
        self._draining = False  # the decompressor may hold output for the next call

    @classmethod
    async def open(cls, path: str, chunk_size: int = CHUNK_SIZE, offset: int = 0) -> ByteSource:
        """``path``, its reads starting ``offset`` uncompressed bytes in.

        A plain file seeks there; a gzip one has no index to seek with, so it is inflated from
        its start and the first ``offset`` bytes are discarded. An offset past the end of the
        (uncompressed) data is a ValueError.
        """
        if offset < 0:
            raise ValueError(f"offset must be at least 0, got {offset}")
        fd = await open_read_only(path)
        source = cls(path, fd, chunk_size)
        if offset:
            try:
                await source._seek(offset)
            except BaseException:
                source.close()
                raise
        return source

    def close(self) -> None:
        """Synchronous, so that it also runs in a generator finalised off its loop."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    async def read(self) -> bytes:
        """The next chunk of (uncompressed) bytes; ``b""`` at the end of the file.

        Raises ``zlib.error`` for corrupt gzip data and :class:`TruncatedGzipError` for a
        gzip file that ends early.
        """
        if self.gzip is None:
            # At least the magic bytes: chunk_size=1 missed a gzip file without the suffix.
            first = await self._read_raw(max(self.chunk_size, len(GZIP_MAGIC)))
            self.gzip = self.path.endswith(".gz") or first.startswith(GZIP_MAGIC)
            if not self.gzip:
                return first
            self._pending = first
            if not first:
                return b""
        if not self.gzip:
            return await self._read_raw()
        return await self._read_gzip()

    async def _seek(self, offset: int) -> None:
        self.gzip = await asyncio.to_thread(self._detect_and_seek, offset)
        # Discarded in pieces of at least CHUNK_SIZE, each at most what is left to discard:
        # the last one ends exactly at the offset, so no output is held back for read().
        step = max(self.chunk_size, CHUNK_SIZE)
        left = offset
        while left and self.gzip:
            discarded = len(await self._read_gzip(min(left, step)))
            if not discarded:
                raise ValueError(f"cannot seek to byte {offset} of {self.path}: it inflates "
                                 f"to {offset - left} bytes")
            left -= discarded

    def _detect_and_seek(self, offset: int) -> bool:
        """Whether the file is gzip; a plain one is left at ``offset``. Runs in a thread."""
        if self.path.endswith(".gz") or os.read(self._fd, len(GZIP_MAGIC)) == GZIP_MAGIC:
            os.lseek(self._fd, 0, os.SEEK_SET)
            return True
        size = os.fstat(self._fd).st_size
        if offset > size:
            raise ValueError(f"cannot seek to byte {offset} of {self.path}: it has {size} bytes")
        os.lseek(self._fd, offset, os.SEEK_SET)
        return False

    async def _read_raw(self, size: int | None = None) -> bytes:
        # aiofiles binds a file to the loop that opened it; the pass may move to another
        # loop (see the class docstring), so the same descriptor is re-wrapped for each.
        loop = asyncio.get_running_loop()
        if self._file is None or self._loop is not loop:
            self._file = await aiofiles.open(self._fd, "rb", buffering=0, closefd=False,
                                             loop=loop)
            self._loop = loop
        data = await self._file.read(self.chunk_size if size is None else size)
        return data or b""

    async def _read_gzip(self, limit: int | None = None) -> bytes:
        """At most ``limit`` (default: chunk size) inflated bytes; ``b""`` at the end."""
        limit = self.chunk_size if limit is None else limit
        while True:
            if not self._pending and not self._draining:
                self._pending = await self._read_raw(max(self.chunk_size, min(limit, CHUNK_SIZE)))
                if not self._pending:
                    if self._inflate is not None:
                        raise TruncatedGzipError(
                            "the compressed file ended before the end-of-stream marker")
                    return b""
            if self._inflate is None:
                # A new member: gzip files may hold several, and zero padding after the last.
                self._pending = self._pending.lstrip(b"\0")
                if not self._pending:
                    continue
                self._inflate = zlib.decompressobj(wbits=31)
            out: bytes = self._inflate.decompress(self._pending, limit)
            if self._inflate.eof:
                self._pending = self._inflate.unused_data
                self._inflate = None
                self._draining = False
            else:
                self._pending = self._inflate.unconsumed_tail
                self._draining = len(out) >= limit
            if out:
                return out


async def open_read_only(path: str) -> int:
    """``os.open(path, O_RDONLY)`` off the loop; cancelled, it leaves no descriptor open.

    The thread opens the file anyway, perhaps after the loop that waited for it is closed
    (a loader closed while a next shard opened ahead): whoever comes last of the thread and
    the cancelled caller closes it, on no loop's callback.
    """
    opening = _Opening(path)
    try:
        await asyncio.to_thread(opening.run)
    except BaseException:
        opening.abandon()
        raise
    return opening.take()


class _Opening:
    __slots__ = ("_fd", "_lock", "_path", "_wanted")

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._wanted = True

    def run(self) -> None:
        """In the thread."""
        fd = os.open(self._path, os.O_RDONLY)
        with self._lock:
            if self._wanted:
                self._fd = fd
                return
        os.close(fd)

    def take(self) -> int:
        with self._lock:
            fd, self._fd = self._fd, None
        assert fd is not None  # run() returned without raising
        return fd

    def abandon(self) -> None:
        with self._lock:
            self._wanted = False
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
