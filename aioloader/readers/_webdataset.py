"""WebDatasetReader: samples of WebDataset tar shards, local or remote, resumable by offset."""

from __future__ import annotations

import asyncio
import collections
import io
import json
import os
import re
import tarfile
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from typing import Any

from .._info import get_worker_info
from ..pipeline._loads import Retry
from ._fsspec import url_list
from ._pieces import OnError, PieceReader
from ._ranges import AHEAD, CHUNK, Ahead, Files, is_remote

BLOCK = 512
_NAME = "WebDatasetReader"
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_FILE = (tarfile.REGTYPE, tarfile.AREGTYPE)
_FAST = (*_FILE, tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE)  # header types parse_header reads
_IMAGE = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "bmp", "webp", "tif", "tiff",
                    "gif"})


class WebDatasetError(ValueError):
    """A tar shard is corrupt or truncated, or a member does not decode. ``url`` is the
    shard, ``member`` the tar member (or the sample key) where it went wrong."""

    def __init__(self, message: str, url: str, member: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.member = member
        self.offset = offset  # of the header of a member cut short (None: not known)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.url, self.member, self.offset))


def expand_braces(pattern: str) -> list[str]:
    """``shard-{000..002}.tar`` -> the three names (zero padding kept); ``{a,b}`` too.

    Examples:
        >>> expand_braces("s-{08..10}.tar")
        ['s-08.tar', 's-09.tar', 's-10.tar']
        >>> expand_braces("{train,val}-{0..1}.tar")
        ['train-0.tar', 'train-1.tar', 'val-0.tar', 'val-1.tar']
    """
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[:match.start()], pattern[match.end():], match.group(1)
    span = _RANGE.match(body)
    if span is not None:
        low, high = int(span.group(1)), int(span.group(2))
        width = len(span.group(1)) if span.group(1).lstrip("-").startswith("0") else 0
        step = 1 if high >= low else -1
        items = [str(i).zfill(width) for i in range(low, high + step, step)]
    else:
        items = body.split(",")
    return [name for item in items for name in expand_braces(head + item + tail)]


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) as the webdataset library groups members: the key is the path up to
    the first dot of its base name; None for a name without one (not part of a sample)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0 or dot == slash:
        return None
    return name[:dot], name[dot + 1:].lower()


def decode_member(ext: str, data: bytes) -> Any:
    """The common extensions decoded: images to uint8 CHW tensors, ``json``, ``txt``/``text``
    to str, ``cls``/``cls2``/``index`` to int, ``npy`` to an array, ``pth`` with
    ``torch.load(weights_only=True)``; anything else is left as bytes."""
    last = ext.rsplit(".", 1)[-1]
    if last in _IMAGE:
        import numpy as np
        import PIL.Image
        import torch

        with PIL.Image.open(io.BytesIO(data)) as image:
            array = np.asarray(image.convert("RGB") if image.mode not in ("RGB", "L")
                               else image)
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array.copy()).permute(2, 0, 1)
    if last == "json":
        return json.loads(data)
    if last in ("txt", "text"):
        return data.decode("utf-8")
    if last in ("cls", "cls2", "index"):
        return int(data)
    if last == "npy":
        import numpy as np

        return np.load(io.BytesIO(data), allow_pickle=False)
    if last == "pth":
        import torch

        return torch.load(io.BytesIO(data), weights_only=True)
    return data


Decode = Callable[[dict[str, Any]], Any]


class WebDatasetReader(PieceReader):
    """Samples of WebDataset tar shards: ``{"__key__", "__url__", ext: bytes, ...}``.

    ``urls`` (or the loader's ``data_path``) is a shard or a list of them: local paths or
    fsspec URLs (``s3://``, ``gs://``, ``https://``), each may be a brace pattern
    (``shard-{000000..000099}.tar``). Members are grouped into samples as the webdataset
    library groups them: the key is a member's path up to the first dot of its base name,
    the rest (lowercased) its extension.

    The reader shards itself: with S readers (world size x workers), shard i of the pass's
    order goes to reader i % S; with fewer shards than readers, each reads every shard and
    keeps samples s, s + S, ... of the pass. ``shuffle_shards`` reorders the shards every
    pass, from ``seed`` (the same order in every process). Shuffle samples with the
    loader's ``shuffle=True`` and ``max_instances_in_memory`` (a seeded buffer that resumes
    exactly).

    ``state_dict()`` is (pass, shard, byte offset of the next sample's first member):
    :meth:`load_state_dict` makes the next pass seek there, so a resume reads nothing twice.
    It is taken per reader (rank x worker); every rank's states resume on other numbers
    of workers and ranks too (:meth:`reshape_state`, which the loader calls).

    Shards stream through ranged reads, ``ahead`` chunks of ``chunk_size`` bytes in flight
    (bounded memory), each retried on transient errors (``retries``); the next ``ahead``
    shards are opened, and the first chunk of each requested, while one is read.

    Args:
        urls: shards; None: the loader's ``data_path``.
        decode: None: members stay bytes; True: :func:`decode_member` for each; a function
            ``sample -> instance`` (picklable for ``start_method="spawn"``). Decoding runs in
            the worker (with ``num_workers=0``, in a thread: never on the caller's loop).
        storage_options: for the filesystem of remote shards (as ``FsspecReader``'s).
        shuffle_shards: another shard order each pass, the same in every process.
        seed: of that order.
        on_error: "raise" (a :class:`WebDatasetError` naming the shard and member) or
            "skip": a corrupt or truncated shard's rest, or a sample that does not decode,
            is left out, warned about once, counted in the loader's ``stats().skipped``
            and ``skipped``, and in ``num_skipped`` (of the reader that read it: in a
            worker, its copy).
        chunk_size: bytes per ranged read of a shard.
        ahead: ranged reads in flight for the shard being read, and shards opened ahead of
            it, one chunk each (memory: ``2 x ahead x chunk_size`` per reader).
        retries: more attempts per read on transient errors (``aioloader.Retry``'s rules).

    Examples:
        >>> reader = WebDatasetReader("data/shard-{000000..000009}.tar", decode=True)
        >>> len(reader.urls)
        10
    """

    reader_name = _NAME

    def __init__(self, urls: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
                 | None = None, *, decode: bool | Decode | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 shuffle_shards: bool = False, seed: int = 0, on_error: OnError = "raise",
                 chunk_size: int = CHUNK, ahead: int = AHEAD, retries: int = 3) -> None:
        if decode is not None and not isinstance(decode, bool) and not callable(decode):
            raise TypeError(f"decode must be None, True or a function sample -> instance, "
                            f"got {type(decode).__name__}")
        self._setup(on_error=on_error, seed=seed)
        if chunk_size < BLOCK or ahead < 1:
            raise ValueError(f"chunk_size must be at least {BLOCK} and ahead at least 1, got "
                             f"{chunk_size} and {ahead}")
        self.urls = None if urls is None else shard_list(urls)
        self.decode = decode
        self.storage_options = dict(storage_options or {})
        self.shuffle_shards = shuffle_shards
        self.chunk_size = chunk_size
        self.ahead = ahead
        self.retry = Retry(retries)

    def __repr__(self) -> str:
        return (f"WebDatasetReader({self.urls!r}, decode={self.decode!r}, "
                f"shuffle_shards={self.shuffle_shards!r}, on_error={self.on_error!r})")

    def read(self, data_path: Any = None) -> AsyncIterator[Any]:
        """This process's samples of the shards (``urls``, else ``data_path``)."""
        urls = self.urls if self.urls is not None else shard_list(data_path)
        return self._read(urls, *self._next_pass())

    async def _read(self, urls: list[str], loaded: dict[str, Any] | None,
                    pass_no: int) -> AsyncIterator[Any]:
        skips = self._skips()
        # the next shards (up to ``ahead``), opening meanwhile, each with its first chunk asked
        upcoming: collections.deque[asyncio.Task[Ahead]] = collections.deque()
        async with Files(self.storage_options) as files:

            def opening(url: str, start: int) -> Awaitable[Ahead]:
                return files.ahead(url, start, chunk=self.chunk_size, ahead=self.ahead,
                                   retry=self.retry)

            async def count(piece: int, offset: int, item: int, limit: int | None) -> int:
                return await self._count(opening(urls[piece], offset), urls[piece], limit)

            at = await self._begin(urls, loaded, pass_no, shuffle=self.shuffle_shards,
                                   count=count)
            dealt = at.deal
            step, first = dealt.step, dealt.first
            mine = dealt.mine
            try:
                while at.piece < len(mine):
                    url = urls[mine[at.piece]]
                    cut = at.cut(mine[at.piece])
                    if upcoming:  # opened where a next shard starts
                        source = await upcoming.popleft()
                    else:
                        source = await opening(url, at.offset)
                    while (len(upcoming) < self.ahead
                           and at.piece + 1 + len(upcoming) < len(mine)):
                        piece = at.piece + 1 + len(upcoming)
                        upcoming.append(asyncio.ensure_future(opening(
                            urls[mine[piece]], at.start_of(piece)[0])))
                    samples = _samples(source, url)
                    try:
                        while True:
                            try:
                                got = await samples.__anext__()
                            except StopAsyncIteration:
                                break
                            except WebDatasetError as exc:
                                await self._skip(skips, url, exc.member, exc)
                                break  # a tar cannot be resynchronised: its rest goes
                            sample, after = got
                            n, item = at.counted, at.item
                            at.offset, at.item = after, item + 1
                            if cut is not None and cut.has(item):
                                continue  # delivered before a resume on another shape
                            at.counted = n + 1
                            if step > 1 and (n - first) % step:
                                continue
                            try:
                                instance = await self._decoded(sample, url)
                            except WebDatasetError as exc:
                                await self._skip(skips, url, exc.member, exc)
                                continue
                            yield instance
                    finally:  # closed here, not by the loop's finalizer (see ByteSource)
                        try:
                            await samples.aclose()
                        finally:
                            await source.aclose()
                    at.next_piece()
            finally:
                while upcoming:
                    await _discard(upcoming.popleft())

    async def _count(self, opening: Awaitable[Ahead], url: str, limit: int | None) -> int:
        """Samples of a shard from an offset on (at most ``limit``), read again to count
        them: as a pass reads them (a damaged rest counts as that pass did, skipped)."""
        source = await opening
        samples = _samples(source, url)
        n = 0
        try:
            while limit is None or n < limit:
                try:
                    await samples.__anext__()
                except StopAsyncIteration:
                    break
                except WebDatasetError:
                    if self.on_error == "raise":
                        raise
                    break
                n += 1
        finally:
            try:
                await samples.aclose()
            finally:
                await source.aclose()
        return n

    async def _decoded(self, sample: dict[str, Any], url: str) -> Any:
        decode = self.decode
        if decode is None or decode is False:
            return sample
        fn: Decode = _decode_all if decode is True else decode
        try:
            if get_worker_info() is not None:  # a worker's loop is there to decode on
                return fn(sample)
            # In the caller's process: off its event loop, which must never block.
            return await asyncio.to_thread(fn, sample)
        except Exception as exc:
            raise WebDatasetError(f"{url}: sample {sample['__key__']!r} does not decode "
                                  f"({exc!r}); fix or drop it, or pass on_error='skip'",
                                  url, str(sample["__key__"])) from exc


async def _discard(opening: asyncio.Task[Ahead]) -> None:
    """A next shard that will not be read: stop its opening, or close what it opened."""
    opening.cancel()
    done = await asyncio.gather(opening, return_exceptions=True)
    if isinstance(done[0], Ahead):
        await done[0].aclose()


def _decode_all(sample: dict[str, Any]) -> dict[str, Any]:
    return {ext: value if ext.startswith("__") else decode_member(ext, value)
            for ext, value in sample.items()}


def shard_list(urls: Any) -> list[str]:
    """The shards ``urls`` names, braces expanded, in the order given."""
    out = [name for item in url_list(urls) for name in expand_braces(item)]
    if len({is_remote(name) and name.split("://", 1)[0] for name in out}) > 1:
        raise ValueError("shards of several protocols: a WebDatasetReader reads from one "
                         "filesystem")
    return out


def _corrupt(url: str, member: str, what: str, offset: int | None = None) -> WebDatasetError:
    return WebDatasetError(f"{url}: {what} (member {member}); the shard is corrupt or "
                           "truncated: write or download it again, or pass on_error='skip' "
                           "to leave its rest out", url, member, offset)


async def _members(source: Ahead, url: str) -> AsyncGenerator[tuple[int, str, bytes]]:
    """(header offset, name, data) of each regular file in the tar from the source's offset."""
    long_name: str | None = None
    last = "(the start)"
    while True:
        at = source.offset
        header = await source.read(BLOCK)
        if not header:
            return  # an archive without its end-of-archive blocks: what webdataset accepts
        if len(header) < BLOCK:
            raise _corrupt(url, last, f"the file ends inside a tar header at byte {at}")
        if header == b"\0" * BLOCK:
            return
        try:
            header_name, size, kind = parse_header(header)
        except tarfile.HeaderError as exc:
            raise _corrupt(url, last, f"no valid tar header at byte {at} ({exc})") from exc
        # the data, then its padding: the data is not sliced (copied) out of a padded read
        data = await source.read(size)
        pad = -size % BLOCK
        whole = len(data) == size and (not pad or len(await source.read(pad)) == pad)
        name = long_name if long_name is not None else header_name
        long_name = None
        if not whole:
            raise _corrupt(url, name, f"the file ends inside member {name!r} (byte {at}, "
                           f"{size} bytes; the file has {source.size})", at)
        if kind == tarfile.GNUTYPE_LONGNAME:
            long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind == tarfile.XHDTYPE:
            long_name = _pax_path(data)
        elif kind in _FILE:
            last = name
            yield at, name, data


def parse_header(block: bytes) -> tuple[str, int, bytes]:
    """(name, size, type) of a 512-byte tar header, as ``tarfile.TarInfo.frombuf`` reads them.

    The members of a shard take the fast path: their name, size and checksum only, where
    ``frombuf`` converts every field of the header with a Python call each (most of a raw
    read's time in a worker, measured with py-spy). Anything else (a directory, a link, a
    base-256 size, a checksum that does not match) is left to ``frombuf``, which also raises
    ``tarfile.HeaderError`` for an invalid one.
    """
    kind = block[156:157]
    if kind in _FAST and block[124] < 0x80 and len(block) == BLOCK:
        try:
            size = int(_field(block[124:136]) or b"0", 8)
            checksum = int(_field(block[148:156]) or b"0", 8)
        except ValueError:
            pass
        else:
            # the checksum counts its own field as spaces (8 x 32): tar's unsigned sum
            if checksum == sum(block) - sum(block[148:156]) + 256:
                name = block[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                prefix = block[345:500].split(b"\0", 1)[0]
                if not (kind == tarfile.AREGTYPE and name.endswith("/")):  # a directory
                    if prefix and kind != tarfile.GNUTYPE_LONGNAME:
                        name = prefix.decode("utf-8", "surrogateescape") + "/" + name
                    return name, size, kind
    info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    return info.name, info.size, info.type


def _field(raw: bytes) -> bytes:
    """A numeric field's digits, as ``tarfile.nti`` reads an octal one."""
    return raw.split(b"\0", 1)[0].strip()


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header, if any."""
    path = None
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "surrogateescape")
        pos += length
    return path


async def _samples(source: Ahead, url: str) -> AsyncGenerator[tuple[dict[str, Any], int]]:
    """(sample, the byte offset just after it) for each sample of the shard from the source's
    offset on; members with the same key in a row form a sample, as webdataset groups
    them."""
    sample: dict[str, Any] | None = None
    members = _members(source, url)
    try:
        while True:
            try:
                at, name, data = await members.__anext__()
            except StopAsyncIteration:
                break
            except WebDatasetError as exc:
                # A member cut short after its header: the sample before it is whole.
                parts = split_name(exc.member)
                if sample is not None and exc.offset is not None and parts is not None and (
                        parts[0] != sample["__key__"]):
                    yield sample, exc.offset
                raise
            parts = split_name(name)
            if parts is None:
                continue
            key, ext = parts
            if sample is not None and sample["__key__"] != key:
                yield sample, at
                sample = None
            if sample is None:
                sample = {"__key__": key, "__url__": url}
            if ext in sample:
                raise _corrupt(url, name, f"sample {key!r} holds {ext!r} twice")
            sample[ext] = data
        if sample is not None:
            yield sample, source.offset
    finally:
        await members.aclose()
