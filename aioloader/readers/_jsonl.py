"""JsonLinesReader: JSON-lines files (plain or gzip), read asynchronously, sharded by itself."""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import itertools
import json
import os
import warnings
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .._info import get_worker_info
from ..plans._sources import Reader
from ._files import CHUNK_SIZE, ByteSource, TruncatedGzipError, expand_paths

_DECODE = json.JSONDecoder().decode  # what json.loads(str) calls, minus its checks
LOOP_TURN = 256  # lines parsed between two turns given to the event loop
STATE_VERSION = 1  # of the dicts that JsonLinesReader.state_dict() returns
_BOM = codecs.BOM_UTF8
_STATE_INTS = ("shard", "shards", "file", "offset", "file_lines", "lines_before")


class JsonLinesError(ValueError):
    """A JSON-lines file holds a line that does not parse, or corrupt compressed data.

    ``path`` is the file and ``line_number`` the 1-based line (for corrupt gzip data, the
    line the reader had reached).
    """

    def __init__(self, message: str, path: str, line_number: int) -> None:
        super().__init__(message)
        self.path = path
        self.line_number = line_number

    def __reduce__(self) -> tuple[Any, ...]:
        # Travels from a worker to the parent intact (the WorkerError's __cause__).
        return (type(self), (self.args[0], self.path, self.line_number))


class JsonLinesReader(Reader):
    """Reads JSON-lines files: one JSON value per line, each becomes an instance.

    ``data_path`` is a path, a glob pattern (``"data/*.jsonl"``, ``"data/**/*.jsonl.gz"``)
    or a list of those; the files are read in sorted order, gzip ones (``.gz`` suffix or
    gzip magic bytes) inflated on the fly, in bounded memory. Blank lines are skipped.

    The reader shards itself across workers and ``torch.distributed`` ranks: with S shards
    (world_size x num_workers), file i goes to shard i % S when there are at least S files,
    otherwise line j of the whole sorted corpus goes to shard j % S.

    A pass can be resumed: :meth:`state_dict` is the position after the last instance that
    the latest :meth:`read` pass yielded, and after :meth:`load_state_dict` the next pass
    (same files, same shard) yields exactly the instances that followed it. A plain file is
    seeked to that position and the files before it are not opened; a gzip file has no index
    to seek with, so it is inflated from its start and the bytes before the position are
    discarded (not parsed). ``num_skipped`` counts from 0 again in a resumed pass.

    Args:
        transform: applied to each parsed value; its result is the instance. With
            ``start_method="spawn"`` or ``"forkserver"`` it must be picklable (a module-level
            function or a ``functools.partial`` of one, not a lambda).
        skip_invalid: skip lines that do not parse instead of raising
            :class:`JsonLinesError`; the first one skipped in a pass is warned about, and
            ``num_skipped`` counts them (in the process that read them: in a worker, the
            worker's copy of the reader counts).
        encoding: of the files; an ASCII-compatible one (JSON lines are UTF-8 by definition).

    Examples:
        >>> import aioloader
        >>> from aioloader.readers import JsonLinesReader
        >>> loader = aioloader.DataLoader(JsonLinesReader(), "data/*.jsonl.gz",
        ...                               batch_size=32, num_workers=2)  # doctest: +SKIP
        >>> state = JsonLinesReader().state_dict()  # before any pass: the start
        >>> (state["file"], state["offset"])
        (0, 0)
        >>> resumed = JsonLinesReader()
        >>> resumed.load_state_dict(state)  # the next resumed.read(...) starts there
    """

    manual_multiprocess_sharding = True
    manual_distributed_sharding = True

    def __init__(self, transform: Callable[[Any], Any] | None = None, skip_invalid: bool = False,
                 encoding: str = "utf-8", *, chunk_size: int = CHUNK_SIZE) -> None:
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        codec = codecs.lookup(encoding)  # LookupError for an unknown encoding
        if "{\n}".encode(codec.name) != b"{\n}":
            raise ValueError(f"encoding {encoding!r} is not ASCII-compatible; JSON lines "
                             "files are UTF-8 (or another ASCII-compatible encoding)")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        self.transform = transform
        self.skip_invalid = skip_invalid
        self.encoding = codec.name
        self.chunk_size = chunk_size
        self.num_skipped = 0  # invalid lines skipped in the last pass (skip_invalid=True)
        self._cursor: _Cursor | None = None  # where the latest pass stands
        self._loaded: dict[str, Any] | None = None  # where the next pass starts

    def __getstate__(self) -> dict[str, Any]:
        # A cursor holds the block of lines being parsed (up to a chunk): not worth shipping
        # to a worker, whose copy has not read anything.
        return {**self.__dict__, "_cursor": None}

    def __repr__(self) -> str:
        return (f"JsonLinesReader(transform={self.transform!r}, "
                f"skip_invalid={self.skip_invalid!r}, encoding={self.encoding!r})")

    def files(self, data_path: Any) -> list[str]:
        """The files ``data_path`` names, in the order they are read."""
        return expand_paths(data_path)

    def state_dict(self) -> dict[str, Any]:
        """Where the latest pass stands: just after the last instance it yielded.

        Before any pass, the start; after a pass, its end; after :meth:`load_state_dict`, the
        state loaded. A small dict of JSON values, cheap to take between two instances:
        ``reader`` and ``version`` (of this format), ``shard`` of ``shards``, the files read
        (``num_files`` and ``files_digest``, None before any pass), ``file`` (the index of the
        one being read; ``num_files`` at the end) and its ``path``, ``offset`` (uncompressed
        bytes of it before the position), ``file_lines`` (its lines before the position) and
        ``lines_before`` (lines of the earlier files, for sharding by line).
        """
        if self._loaded is not None:
            return dict(self._loaded)
        return self._cursor.state() if self._cursor is not None else _start_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next :meth:`read` start where ``state`` (from :meth:`state_dict`) was taken.

        Only the next pass: the one after it starts from the beginning again. A dict that is
        not such a state is a ValueError here; one taken over other files or for another
        shard is a ValueError from that pass.
        """
        self._loaded = _checked(state)

    def read(self, data_path: Any) -> AsyncIterator[Any]:
        """This process's share of the instances in the files ``data_path`` names."""
        loaded, self._loaded = self._loaded, None
        cursor = self._cursor = _Cursor(loaded)
        return self._read(data_path, cursor)

    async def _read(self, data_path: Any, cursor: _Cursor) -> AsyncIterator[Any]:
        files = expand_paths(data_path)
        shard, shards = reader_shard()
        by_file = len(files) >= shards
        # Where this pass starts: the file, the offset in it, and the lines before that.
        first_file = offset = file_lines = lines_before = 0
        if cursor.origin is not None:
            _check_fits(cursor.origin, files, shard, shards, by_file)
            first_file, offset, file_lines, lines_before = (
                cursor.origin[key] for key in ("file", "offset", "file_lines", "lines_before"))
        cursor.files, cursor.shard, cursor.shards = files, shard, shards
        decode, encoding, transform = _DECODE, self.encoding, self.transform
        step = 1 if by_file else shards
        self.num_skipped = 0
        parsed = 0
        for i in range(first_file, len(files)):
            if by_file and i % shards != shard:
                continue
            path = files[i]
            cursor.enter(i, lines_before, offset, file_lines)
            source, head = await _open_at(path, self.chunk_size, offset, file_lines)
            try:
                done = offset  # the byte offset of the first byte not yet in a block
                tail: list[bytes] = []  # the start of a line that continues in the next chunk
                eof = False
                while not eof:
                    chunk = head or await _read_chunk(source, file_lines)
                    head = b""
                    if chunk:
                        end = chunk.rfind(b"\n")
                        if end < 0:
                            tail.append(chunk)
                            continue
                        block = b"".join([*tail, chunk[:end]]) if tail else chunk[:end]
                        tail = [chunk[end + 1:]] if end + 1 < len(chunk) else []
                        start, done = done, done + len(block) + 1
                    else:  # the end of the file: a last line without a newline
                        eof = True
                        if not tail:
                            break
                        block, tail = b"".join(tail), []
                        start, done = done, done + len(block)
                    skew = 0
                    if start == 0 and block.startswith(_BOM):  # a chunk may hold part of it
                        block, skew = block[len(_BOM):], len(_BOM)
                    lines = block.split(b"\n")
                    cursor.start, cursor.end, cursor.skew = start, done, skew
                    cursor.block_lines, cursor.lines, cursor.k = file_lines, lines, -1
                    first = 0 if by_file else (shard - lines_before - file_lines) % shards
                    for k in range(first, len(lines), step):
                        line = lines[k]
                        if not line or line.isspace():
                            continue
                        try:
                            value = decode(line.decode(encoding))
                        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                            self._invalid(path, file_lines + k + 1, exc)
                            continue
                        cursor.k = k  # all the bookkeeping per line: state() does the rest
                        yield value if transform is None else transform(value)
                        parsed += 1
                        if parsed % LOOP_TURN == 0:  # parsing a chunk must not hog the loop
                            await asyncio.sleep(0)
                    file_lines += len(lines)
            finally:
                source.close()
            lines_before += file_lines
            offset = file_lines = 0
        cursor.enter(len(files), lines_before, 0, 0)

    def _invalid(self, path: str, line_number: int, exc: ValueError) -> None:
        """Raise for a line that does not parse, or count it (and warn about the first)."""
        if not self.skip_invalid:
            raise JsonLinesError(f"{path}, line {line_number}: invalid JSON: {exc}",
                                 path, line_number) from exc
        self.num_skipped += 1
        if self.num_skipped == 1:
            warnings.warn(f"{path}, line {line_number}: skipping invalid JSON ({exc}); "
                          "further invalid lines are skipped without a warning and counted "
                          "in JsonLinesReader.num_skipped", UserWarning, stacklevel=2)


async def _read_chunk(source: ByteSource, lines_done: int) -> bytes:
    """The next chunk of ``source``; corrupt gzip data as a :class:`JsonLinesError`."""
    try:
        return await source.read()
    except (zlib.error, TruncatedGzipError) as exc:
        raise JsonLinesError(f"{source.path}: corrupt gzip data after line {lines_done} "
                             f"({exc})", source.path, lines_done) from exc


async def _open_at(path: str, chunk_size: int, offset: int, lines_done: int,
                   ) -> tuple[ByteSource, bytes]:
    """``path`` opened at ``offset``, and the bytes already read past it.

    A resumed pass checks the byte before the offset: a line must start there (or the file
    end, after a last line without a newline), else the state does not fit the file.
    """
    if not offset:
        return await ByteSource.open(path, chunk_size), b""
    past_end = f"JsonLinesReader state does not fit {path}: offset {offset} is past its end"
    try:
        source = await ByteSource.open(path, chunk_size, offset - 1)
    except ValueError as exc:
        raise ValueError(past_end) from exc
    except (zlib.error, TruncatedGzipError) as exc:
        raise JsonLinesError(f"{path}: corrupt gzip data before byte {offset} ({exc})",
                             path, lines_done) from exc
    try:
        before = await _read_chunk(source, lines_done)
        if before[:1] == b"\n":
            return source, before[1:]
        if not before:
            raise ValueError(past_end)
        if len(before) > 1 or await _read_chunk(source, lines_done):
            raise ValueError(f"JsonLinesReader state does not fit {path}: offset {offset} is "
                             "not where a line starts (did the file change?)")
        return source, b""
    except BaseException:
        source.close()
        raise


@dataclass(slots=True, eq=False)
class _Cursor:
    """Where one pass stands: the block of lines it yields from, and the last one it yielded.

    The pass updates it once per block, and once per instance only ``k``; :meth:`state` does
    the arithmetic when asked.
    """

    origin: dict[str, Any] | None  # the loaded state the pass starts from, if any
    files: list[str] | None = None  # None until the pass has started
    shard: int = 0
    shards: int = 1
    file: int = 0  # index in files of the file being read; len(files) at the end
    lines_before: int = 0  # lines of the earlier files (the ones this shard read)
    start: int = 0  # byte offset in the file (uncompressed) where the block starts
    end: int = 0  # and just past it: past its newline, if it has one
    skew: int = 0  # bytes of a BOM cut off the block's first line
    block_lines: int = 0  # lines of the file before the block
    lines: list[bytes] = field(default_factory=list)
    k: int = -1  # index in lines of the last line yielded; -1: none of this block yet
    digest: str | None = None  # of files, computed once

    def enter(self, file: int, lines_before: int, offset: int, file_lines: int) -> None:
        self.file, self.lines_before, self.start, self.end = file, lines_before, offset, offset
        self.skew, self.block_lines, self.lines, self.k = 0, file_lines, [], -1

    def state(self) -> dict[str, Any]:
        if self.files is None:  # the pass has not started
            return dict(self.origin) if self.origin is not None else _start_state()
        k, lines = self.k, self.lines
        if k + 1 == len(lines):
            offset = self.end
        elif k < 0:
            offset = self.start
        else:  # each line up to k and its newline
            offset = self.start + self.skew + sum(map(len, itertools.islice(lines, k + 1))) + k + 1
        if self.digest is None:
            self.digest = _digest(self.files)
        return {
            "reader": "JsonLinesReader", "version": STATE_VERSION,
            "shard": self.shard, "shards": self.shards,
            "num_files": len(self.files), "files_digest": self.digest,
            "file": self.file,
            "path": self.files[self.file] if self.file < len(self.files) else None,
            "offset": offset, "file_lines": self.block_lines + k + 1,
            "lines_before": self.lines_before,
        }


def _start_state() -> dict[str, Any]:
    """The state before any pass: the start of whatever files it reads."""
    shard, shards = reader_shard()
    return {"reader": "JsonLinesReader", "version": STATE_VERSION, "shard": shard,
            "shards": shards, "num_files": None, "files_digest": None, "file": 0, "path": None,
            "offset": 0, "file_lines": 0, "lines_before": 0}


def _digest(files: list[str]) -> str:
    return hashlib.blake2b(b"\0".join(map(os.fsencode, files)), digest_size=16).hexdigest()


def _checked(state: Any) -> dict[str, Any]:
    """A copy of ``state`` when it is a JsonLinesReader state, else a ValueError."""
    if not isinstance(state, dict) or state.get("reader") != "JsonLinesReader":
        what = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else (
            f"a {type(state).__name__}")
        raise ValueError(f"not a JsonLinesReader state: {what}; pass what "
                         "JsonLinesReader.state_dict() returned")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"JsonLinesReader state version {state.get('version')!r} is not "
                         f"supported: this aioloader reads version {STATE_VERSION}")

    def corrupt(why: str) -> ValueError:
        return ValueError(f"corrupt JsonLinesReader state: {why}")

    for key in _STATE_INTS:
        value = state.get(key)
        if type(value) is not int or value < 0:
            raise corrupt(f"{key!r} is {value!r}, not an int >= 0")
    num_files, file, path = state.get("num_files"), state["file"], state.get("path")
    if state["shard"] >= state["shards"]:
        raise corrupt(f"shard {state['shard']} of {state['shards']}")
    if num_files is None:  # taken before any pass
        if any(state[key] for key in ("file", "offset", "file_lines", "lines_before")):
            raise corrupt("a position without the files it is in")
    elif type(num_files) is not int or not 0 <= file <= num_files:
        raise corrupt(f"file {file} of {num_files!r}")
    elif not isinstance(state.get("files_digest"), str):
        raise corrupt(f"'files_digest' is {state.get('files_digest')!r}")
    elif not (isinstance(path, str) if file < num_files else path is None):
        raise corrupt(f"'path' is {path!r} for file {file} of {num_files}")
    return dict(state)


def _check_fits(state: dict[str, Any], files: list[str], shard: int, shards: int,
                by_file: bool) -> None:
    """A ValueError naming what differs when ``state`` was taken in another pass than this."""
    num_files, file = state["num_files"], state["file"]
    if num_files is None:  # taken before any pass: the start of any files, in any shard
        return
    if (state["shard"], state["shards"]) != (shard, shards):
        raise ValueError(f"JsonLinesReader state was taken for shard {state['shard']} of "
                         f"{state['shards']}, this read is shard {shard} of {shards}")
    if num_files != len(files):
        raise ValueError(f"JsonLinesReader state was taken over {num_files} files, this read "
                         f"has {len(files)}")
    if file < len(files) and files[file] != state["path"]:
        raise ValueError(f"JsonLinesReader state was taken in file {file} {state['path']!r}, "
                         f"this read's file {file} is {files[file]!r}")
    if state["files_digest"] != _digest(files):
        raise ValueError(f"JsonLinesReader state was taken over other files than this read's "
                         f"{len(files)} (the same number, other paths)")
    if by_file and file < len(files) and file % shards != shard:
        raise ValueError(f"corrupt JsonLinesReader state: file {file} is not shard {shard}'s "
                         f"of {shards}")


def reader_shard() -> tuple[int, int]:
    """(shard id, number of shards) of this process: rank x num_workers + worker id."""
    info = get_worker_info()
    if info is not None:
        return info.rank * info.num_workers + info.id, info.world_size * info.num_workers
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
