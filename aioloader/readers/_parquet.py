"""ParquetReader: rows (or whole batches as tensors) of Parquet files, by row group."""

from __future__ import annotations

import asyncio
import collections
import os
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._files import expand_paths
from ._fsspec import url_list
from ._leftover import Cut
from ._pieces import OnError, PieceReader
from ._ranges import AHEAD, is_remote

_NAME = "ParquetReader"
_GLOB_CHARS = frozenset("*?[")


class ParquetError(ValueError):
    """A Parquet file (``path``) that cannot be read: its footer, or row group ``row_group``
    (None: the footer)."""

    def __init__(self, message: str, path: str, row_group: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.row_group = row_group

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.path, self.row_group))


@dataclass(frozen=True, slots=True)
class _Piece:
    file: int
    row_group: int
    rows: int


def to_tensors(table: Any) -> dict[str, Any]:
    """An Arrow table (or record batch) as a batch: numeric and boolean columns without
    nulls become tensors straight from Arrow's buffers (no Python object per value; a
    fixed-size list of numbers a 2-D tensor); any other column (strings, nulls, nested) a
    list of Python values.

    Examples:
        >>> import pyarrow as pa
        >>> batch = to_tensors(pa.table({"x": [1, 2], "s": ["a", "b"]}))
        >>> batch["x"].tolist(), batch["s"]
        ([1, 2], ['a', 'b'])
    """
    import pyarrow as pa
    import torch

    out: dict[str, Any] = {}
    # Arrow's buffers are read-only; torch warns about that for every column. Each batch's
    # tensors are its own rows' memory (the worker copies them into its arena anyway).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, column in zip(table.column_names, table.columns, strict=True):
            out[name] = _column(pa, torch, column)
    return out


def _column(pa: Any, torch: Any, column: Any) -> Any:
    """One column as a tensor (numbers, no nulls) or a list of Python values."""
    kind = column.type
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    if array.null_count == 0 and (numeric or pa.types.is_boolean(kind)):
        return torch.from_numpy(array.to_numpy(zero_copy_only=False))
    if array.null_count == 0 and pa.types.is_fixed_size_list(kind) and (
            pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
        flat = array.flatten()
        if flat.null_count == 0:
            values = flat.to_numpy(zero_copy_only=False)
            return torch.from_numpy(values.reshape(len(array), kind.list_size))
    return array.to_pylist()


def prebatched(items: list[Any]) -> Any:
    """The ``collate_fn`` for instances that are whole batches already (``ParquetReader(...,
    batch_rows=n)``), with ``batch_size=1``: the batch as the reader made it, without a
    leading dimension of 1 and without another pass over its values.

    Examples:
        >>> prebatched([{"x": [1, 2]}])
        {'x': [1, 2]}
    """
    if len(items) != 1:
        raise ValueError(f"prebatched collates one instance that is a whole batch, got "
                         f"{len(items)}: pass batch_size=1 to the loader")
    return items[0]


class ParquetReader(PieceReader):
    """Rows of Parquet files as dicts, or (``batch_rows=n``) batches of n rows as tensors.

    ``paths`` (or the loader's ``data_path``) is a file, a glob or a list of them: local
    paths or fsspec URLs (``s3://``, ``gs://``, ...). Row groups are the unit of sharding and
    position: with S readers (world size x workers), row group i of the pass's order goes to
    reader i % S (with fewer row groups than readers, each reads every one and keeps rows
    s, s + S, ...). ``columns`` reads only those columns.

    ``batch_rows=n`` is the batch-native path: each instance is already a batch of n rows
    (the last of a pass may be shorter), made by :func:`to_tensors` from Arrow's buffers, so
    no row ever becomes a Python dict. Give the loader ``batch_size=1`` and
    ``collate_fn=prebatched`` with it (a reader's loader always batches; a batch of one
    batch is handed over as it is).

    ``state_dict()`` is (pass, row group, row): :meth:`load_state_dict` makes the next pass
    read from that row group on and drop the rows before the position, so a resume reads at
    most one row group again. It is taken per reader (rank x worker); every rank's states
    resume on other numbers of workers and ranks too (:meth:`reshape_state`, which the
    loader calls). ``ahead`` row groups are read ahead in threads.

    Args:
        paths: the files; None: the loader's ``data_path``.
        columns: the columns to read (None: all).
        storage_options: for the filesystem of remote files (as ``FsspecReader``'s).
        batch_rows: None: one dict per row; n: batches of n rows as tensors and lists.
        shuffle_row_groups: another row-group order each pass, the same in every process
            (shuffle rows with the loader's ``shuffle=True`` and ``max_instances_in_memory``).
        seed: of that order.
        on_error: "raise" (a :class:`ParquetError` naming the file and row group) or
            "skip": a row group that does not read is left out, warned about once,
            counted in the loader's ``stats().skipped`` and ``skipped``, and in
            ``num_skipped`` (of the reader that read it: in a worker, its copy).
        ahead: row groups read ahead per worker, in threads.

    Examples:
        >>> reader = ParquetReader("data/*.parquet", columns=["text", "label"])
        >>> reader.columns
        ['text', 'label']
    """

    reader_name = _NAME

    def __init__(self, paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
                 | None = None, *, columns: Sequence[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 batch_rows: int | None = None, shuffle_row_groups: bool = False,
                 seed: int = 0, on_error: OnError = "raise", ahead: int = AHEAD) -> None:
        self._setup(on_error=on_error, seed=seed)
        if batch_rows is not None and (isinstance(batch_rows, bool) or batch_rows < 1):
            raise ValueError(f"batch_rows must be None or an int >= 1, got {batch_rows!r}")
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, got the str {columns!r}")
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1, got {ahead}")
        self.paths = None if paths is None else url_list(paths)
        self.columns = None if columns is None else list(columns)
        self.storage_options = dict(storage_options or {})
        self.batch_rows = batch_rows
        self.shuffle_row_groups = shuffle_row_groups
        self.ahead = ahead

    def __repr__(self) -> str:
        return (f"ParquetReader({self.paths!r}, columns={self.columns!r}, "
                f"batch_rows={self.batch_rows!r}, on_error={self.on_error!r})")

    def read(self, data_path: Any = None) -> AsyncIterator[Any]:
        """This process's rows (or batches) of the files (``paths``, else ``data_path``)."""
        return self._read(data_path, *self._next_pass())

    async def _read(self, data_path: Any, loaded: dict[str, Any] | None,
                    pass_no: int) -> AsyncIterator[Any]:
        skips = self._skips()
        files = _Files(self.paths if self.paths is not None else url_list(data_path),
                       self.storage_options)
        await asyncio.to_thread(files.list_and_open)
        pieces = files.pieces
        names = [f"{files.urls[p.file]}#{p.row_group}" for p in pieces]

        async def count(piece: int, offset: int, item: int, limit: int | None) -> int:
            rows = pieces[piece].rows - item  # (a footer says: nothing is read)
            return rows if limit is None else min(rows, limit)

        at = await self._begin(names, loaded, pass_no, shuffle=self.shuffle_row_groups,
                               count=count)
        dealt = at.deal
        step, first = dealt.step, dealt.first
        columns, batch_rows = self.columns, self.batch_rows
        mine = [pieces[i] for i in dealt.mine]
        window: collections.deque[asyncio.Task[Any]] = collections.deque()
        requested = at.piece
        held: list[Any] = []  # slices of tables not yet a whole batch
        held_rows = 0
        import pyarrow as pa

        try:
            while at.piece < len(mine):
                while requested < len(mine) and len(window) < self.ahead:
                    window.append(asyncio.ensure_future(asyncio.to_thread(
                        files.read, mine[requested], columns)))
                    requested += 1
                piece = mine[at.piece]
                try:
                    table = await window.popleft()
                except ParquetError as exc:
                    await self._skip(skips, files.urls[piece.file], f"row group {piece.row_group}",
                               exc)
                    at.counted += _left(piece.rows, at.offset, at.cut(dealt.mine[at.piece]))
                    at.next_piece()
                    continue
                # The rows of this piece this reader keeps, from the position on.
                rows, counts = _kept(piece.rows, at.offset, at.counted, step, first,
                                     at.cut(dealt.mine[at.piece]))
                if len(rows) == piece.rows - at.offset:  # all of them: a slice, not a copy
                    taken = table.slice(at.offset)
                else:
                    taken = table.take(pa.array(rows, pa.int64())) if rows else table.slice(0, 0)
                ends = at.counted + _left(piece.rows, at.offset, at.cut(dealt.mine[at.piece]))
                if batch_rows is None:
                    for row, r, c in zip(taken.to_pylist(), rows, counts, strict=True):
                        at.offset = at.item = r + 1
                        at.counted = c
                        yield row
                else:
                    done = 0
                    while done < taken.num_rows:
                        want = batch_rows - held_rows
                        part = taken.slice(done, want)
                        held.append(part)
                        held_rows += part.num_rows
                        done += part.num_rows
                        if held_rows == batch_rows:
                            batch = to_tensors(pa.concat_tables(held) if len(held) > 1
                                               else held[0])
                            held, held_rows = [], 0
                            at.offset = at.item = rows[done - 1] + 1
                            at.counted = counts[done - 1]
                            yield batch
                # On to the next piece. Rows still held (a batch that continues there) are
                # read again by a resume: a position is only ever seen at a yield, which is
                # after a whole batch.
                at.counted = ends
                at.next_piece()
            if held:
                yield to_tensors(pa.concat_tables(held))
        finally:
            for task in window:
                task.cancel()
            if window:
                await asyncio.gather(*window, return_exceptions=True)


def _left(rows: int, start: int, cut: Cut | None) -> int:
    """Rows of a row group from ``start`` on that were not delivered before a resume on
    another shape (the items a pass counts)."""
    if cut is None:
        return rows - start
    return sum(1 for r in range(start, rows) if not cut.has(r))


def _kept(rows: int, start: int, counted: int, step: int, first: int,
          cut: Cut | None) -> tuple[list[int], list[int]]:
    """(the rows of a row group this reader keeps from ``start`` on, the pass's count after
    each): those not delivered before a resume on another shape (``cut``), and of them,
    in a split deal, every ``step``-th of the pass from ``first``."""
    left = range(start, rows) if cut is None else [r for r in range(start, rows)
                                                   if not cut.has(r)]
    if step == 1:
        return list(left), list(range(counted + 1, counted + len(left) + 1))
    lead = (first - counted) % step  # rows before the first kept one
    picks = range(lead, len(left), step)
    return [left[k] for k in picks], [counted + k + 1 for k in picks]


class _Files:
    """The files of one pass: listed, their footers read, their row groups as pieces."""

    def __init__(self, specs: list[str], storage_options: dict[str, Any]) -> None:
        self.specs = specs
        self.storage_options = storage_options
        self.urls: list[str] = []
        self.metadata: list[Any] = []
        self.pieces: list[_Piece] = []
        self._fs: Any = None

    def _filesystem(self) -> Any:
        if self._fs is None:
            import fsspec

            from ._fsspec import protocol_of, with_defaults

            protocol = protocol_of(self.specs)
            self._fs = fsspec.filesystem(protocol, **with_defaults(
                protocol, dict(self.storage_options)))
        return self._fs

    def list_and_open(self) -> None:
        """Runs in a thread: lists the files and reads each footer."""
        import pyarrow.parquet as pq

        remote = [is_remote(spec) for spec in self.specs]
        if any(remote):
            fs = self._filesystem()
            urls: set[str] = set()
            for spec in self.specs:
                if _GLOB_CHARS.isdisjoint(spec):
                    urls.add(spec)
                    continue
                found = fs.glob(spec)
                if not found:
                    raise FileNotFoundError(f"cannot list {spec}: no object matches")
                urls.update(fs.unstrip_protocol(p) for p in found)
            self.urls = sorted(urls)
        else:
            self.urls = expand_paths(self.specs)
        for k, url in enumerate(self.urls):
            try:
                with self._open(url) as f:
                    meta = pq.ParquetFile(f).metadata
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                if isinstance(exc, FileNotFoundError):
                    raise
                raise ParquetError(f"{url}: not a readable Parquet file ({exc}); write or "
                                   "download it again", url, None) from exc
            self.metadata.append(meta)
            self.pieces += [_Piece(k, g, meta.row_group(g).num_rows)
                            for g in range(meta.num_row_groups)]

    def _open(self, url: str) -> Any:
        if is_remote(url):
            return self._filesystem().open(url, "rb")
        return open(url.removeprefix("file://"), "rb")

    def read(self, piece: _Piece, columns: list[str] | None) -> Any:
        """Runs in a thread: one row group as an Arrow table."""
        import pyarrow.parquet as pq

        url = self.urls[piece.file]
        try:
            with self._open(url) as f:
                return pq.ParquetFile(f, metadata=self.metadata[piece.file]).read_row_group(
                    piece.row_group, columns=columns)
        except (OSError, ValueError, KeyError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ParquetError(f"{url}: row group {piece.row_group} does not read ({exc}); "
                               "write or download the file again, or pass on_error='skip'",
                               url, piece.row_group) from exc
