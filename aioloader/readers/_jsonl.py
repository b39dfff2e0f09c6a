"""JsonLinesReader: JSON-lines files (plain or gzip), read asynchronously, sharded by itself."""

from __future__ import annotations

import asyncio
import codecs
import json
import warnings
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from .._info import get_worker_info
from .._sources import Reader
from ._files import CHUNK_SIZE, ByteSource, TruncatedGzipError, expand_paths

_DECODE = json.JSONDecoder().decode  # what json.loads(str) calls, minus its checks
LOOP_TURN = 256  # lines parsed between two turns given to the event loop


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

    def __repr__(self) -> str:
        return (f"JsonLinesReader(transform={self.transform!r}, "
                f"skip_invalid={self.skip_invalid!r}, encoding={self.encoding!r})")

    def files(self, data_path: Any) -> list[str]:
        """The files ``data_path`` names, in the order they are read."""
        return expand_paths(data_path)

    async def read(self, data_path: Any) -> AsyncIterator[Any]:
        """This process's share of the instances in the files ``data_path`` names."""
        files = expand_paths(data_path)
        shard, shards = _shard()
        decode, encoding, transform = _DECODE, self.encoding, self.transform
        by_file = len(files) >= shards
        self.num_skipped = 0
        parsed = 0
        lines_before = 0  # physical lines of the earlier files: the global line counter
        for i, path in enumerate(files):
            if by_file and i % shards != shard:
                continue
            step = 1 if by_file else shards
            source = await ByteSource.open(path, self.chunk_size)
            try:
                file_lines = 0  # lines of this file handled so far
                tail: list[bytes] = []  # the start of a line that continues in the next chunk
                first_chunk, eof = True, False
                while not eof:
                    chunk = await _read_chunk(source, file_lines)
                    if chunk:
                        if first_chunk and chunk.startswith(codecs.BOM_UTF8):
                            chunk = chunk[len(codecs.BOM_UTF8):]
                        first_chunk = False
                        end = chunk.rfind(b"\n")
                        if end < 0:
                            tail.append(chunk)
                            continue
                        block = b"".join([*tail, chunk[:end]]) if tail else chunk[:end]
                        tail = [chunk[end + 1:]] if end + 1 < len(chunk) else []
                    else:  # the end of the file: a last line without a newline
                        eof = True
                        if not tail:
                            break
                        block, tail = b"".join(tail), []
                    lines = block.split(b"\n")
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
                        yield value if transform is None else transform(value)
                        parsed += 1
                        if parsed % LOOP_TURN == 0:  # parsing a chunk must not hog the loop
                            await asyncio.sleep(0)
                    file_lines += len(lines)
            finally:
                source.close()
            lines_before += file_lines

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


def _shard() -> tuple[int, int]:
    """(shard id, number of shards) of this process: rank x num_workers + worker id."""
    info = get_worker_info()
    if info is not None:
        return info.rank * info.num_workers + info.id, info.world_size * info.num_workers
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
