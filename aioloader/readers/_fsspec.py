"""FsspecReader: objects behind fsspec URLs (s3://, http://, file://, paths), loaded by key."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

from ..plans._sources import Reader

CONNECT_TIMEOUT = 5.0  # seconds; botocore's default is 60 and aiohttp's 30: fail fast instead
POOL_SIZE = 1024  # connections per filesystem: the loader's `concurrency` is the real bound
_GLOB_CHARS = frozenset("*?[")

Load = Callable[[str], Awaitable[Any]]
URLs = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


class FsspecReader(Reader):
    """Objects named by fsspec URLs: ``read`` lists them, ``loading`` fetches them concurrently.

    ``urls`` (or, when it is None, the loader's ``data_path``) is a URL or a list of URLs:
    a glob (``s3://bucket/train/*.jpg``, ``http://host/o/*``), a prefix or directory (every
    object under it), or one object, on ``s3://``, ``http(s)://``, ``file://`` or a plain
    local path; all of one protocol. :meth:`read` lists them once and yields their full URLs,
    sorted, so every process sees the same keys (the loader shards them). :meth:`loading`
    opens an asynchronous filesystem in the running event loop and gives ``load(url)``, which
    fetches the object's bytes: ``{"url": url, "data": bytes}``, or ``decode(url, data)`` when
    given (a plain function, run on the worker's event loop: keep it cheap, or decode in a
    transform).

    A failed fetch raises at once: retries are the loader's (``retries=``), so botocore's own
    are turned off and s3fs's limited to one attempt. An S3 connection failure surfaces as
    ``ConnectionError`` (``TimeoutError`` for a timeout), chained to botocore's; HTTP ones
    are aiohttp's (``aiohttp.ClientError``: ``ClientResponseError`` with ``.status`` for a bad
    status, ``ClientPayloadError`` for a truncated body, ``ClientConnectionError`` for a
    refused or reset connection; aiohttp itself resends an idempotent request once when a
    connection fails before the response, RFC 9112 section 9.3.1). Connecting times out after
    ``CONNECT_TIMEOUT`` seconds, and up to ``POOL_SIZE`` connections are kept, unless
    ``storage_options`` say otherwise. For S3, one GET per object: s3fs's split downloads
    (a HEAD first) are off unless ``storage_options`` set ``max_concurrency``.

    Args:
        urls: what to read; None: the loader's ``data_path``.
        storage_options: for the filesystem, as ``fsspec.filesystem(protocol, **options)``
            takes them (s3fs: ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``, ...).
        decode: ``decode(url, data) -> instance``; picklable for ``start_method="spawn"``.

    Examples:
        >>> import aioloader
        >>> from aioloader.readers import FsspecReader
        >>> reader = FsspecReader("s3://bucket/train/*.jpg",
        ...                       storage_options={"anon": True})
        >>> loader = aioloader.DataLoader(reader, batch_size=32, num_workers=4,
        ...                               concurrency=64, max_instances_in_memory=1024,
        ...                               )  # doctest: +SKIP
        >>> async def first() -> dict:  # doctest: +SKIP
        ...     url = [u async for u in reader.read(None)][0]
        ...     async with reader.loading() as load:
        ...         return await load(url)
    """

    def __init__(self, urls: URLs | None = None, *,
                 storage_options: Mapping[str, Any] | None = None,
                 decode: Callable[[str, bytes], Any] | None = None) -> None:
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable, got {type(decode).__name__}")
        self.urls = None if urls is None else url_list(urls)
        self.storage_options = dict(storage_options or {})
        self.decode = decode

    def __repr__(self) -> str:
        return (f"FsspecReader({self.urls!r}, storage_options={self.storage_options!r}, "
                f"decode={self.decode!r})")

    def read(self, data_path: Any = None) -> AsyncIterator[str]:
        """The URLs of the objects named (``urls``, else ``data_path``), sorted."""
        return self._read(data_path)

    async def _read(self, data_path: Any) -> AsyncIterator[str]:
        for url in await self.list_urls(data_path):
            yield url

    async def list_urls(self, data_path: Any = None) -> list[str]:
        """What :meth:`read` yields, as a list.

        A list of several URLs without wildcards is taken as it is (no request per object;
        a missing one fails its load). A pattern or prefix that names nothing, a missing
        object or bucket is a ``FileNotFoundError``; an endpoint that cannot be reached a
        ``ConnectionError``; both name the URL.
        """
        specs = self.urls if self.urls is not None else url_list(data_path)
        protocol = protocol_of(specs)
        found: set[str] = set()
        async with Filesystem(protocol, self.storage_options) as fs:
            for spec in specs:
                if len(specs) > 1 and _GLOB_CHARS.isdisjoint(spec):
                    # A list of objects names its keys: no request per object to list it
                    # (a missing one fails its load, naming it).
                    found.add(_full_url(fs, fs_path(fs, spec)))
                    continue
                try:
                    urls = await _expand(fs, spec)
                except Exception as exc:
                    translated = _listing_error(spec, exc, self.storage_options)
                    if translated is None:
                        raise
                    raise translated from exc
                if not urls:
                    raise await _nothing_found(fs, spec, self.storage_options)
                found.update(urls)
        return sorted(found)

    @contextlib.asynccontextmanager
    async def loading(self) -> AsyncIterator[Load]:
        """``load(url) -> instance`` for this process, with the filesystem open until exit.

        Enter it in the event loop that awaits the loads; leaving closes the filesystem's
        connections. Every URL loaded must be of one protocol.
        """
        opened: dict[str, Any] = {}  # protocol -> filesystem, opened on the first load
        opening: list[asyncio.Task[Any]] = []
        lock = asyncio.Lock()
        decode = self.decode
        async with contextlib.AsyncExitStack() as stack:

            async def filesystem(url: str) -> Any:
                protocol = protocol_of([url])
                fs = opened.get(protocol)
                if fs is None:
                    async with lock:
                        if not opened:
                            # In a task of its own, shielded: a load cancelled meanwhile must
                            # not leave the filesystem's context half entered (a session
                            # opened, its close not yet on the stack).
                            opening.append(asyncio.ensure_future(stack.enter_async_context(
                                Filesystem(protocol, self.storage_options))))
                            opened[protocol] = await asyncio.shield(opening[0])
                        elif protocol not in opened:
                            raise ValueError(f"cannot load {url}: this loading() loads "
                                             f"{next(iter(opened))}:// URLs")
                        fs = opened[protocol]
                return fs

            async def load(url: str) -> Any:
                if closed:  # the filesystem would open a new session, never closed
                    raise RuntimeError(f"cannot load {url}: its loading() context has exited")
                fs = await filesystem(url)
                try:
                    data = await fs._cat_file(fs_path(fs, url))
                except Exception as exc:
                    translated = transient(exc, url)
                    if translated is exc:
                        raise
                    raise translated from exc
                return {"url": url, "data": data} if decode is None else decode(url, data)

            closed = False
            try:
                yield load
            finally:
                closed = True
                if opening:  # opened (or failed) before the stack closes what it holds
                    await asyncio.gather(*opening, return_exceptions=True)


def url_list(urls: Any) -> list[str]:
    if isinstance(urls, (str, os.PathLike)):
        items: list[Any] = [urls]
    elif isinstance(urls, Iterable) and not isinstance(urls, (bytes, bytearray)):
        items = list(urls)
    else:
        raise TypeError(f"urls must be a URL, a path or a list of them, got {type(urls).__name__}")
    if not items:
        raise ValueError("no URLs: name at least one object, prefix or glob pattern")
    out = [os.fspath(item) for item in items]
    if not all(isinstance(item, str) for item in out):
        raise TypeError(f"URLs must be str or os.PathLike[str], got {urls!r}")
    return out


def protocol_of(urls: list[str]) -> str:
    """The one protocol of ``urls`` (``file`` for plain paths); s3a is s3, https is http."""
    import fsspec
    from fsspec.core import split_protocol

    classes: dict[type, str] = {}
    for url in urls:
        protocol = split_protocol(url)[0] or "file"
        cls = fsspec.get_filesystem_class(protocol)
        classes.setdefault(cls, protocol if isinstance(cls.protocol, str) else cls.protocol[0])
    if len(classes) > 1:
        raise ValueError(f"URLs of several protocols ({', '.join(classes.values())}): an "
                         "FsspecReader reads from one filesystem")
    return next(iter(classes.values()))


class Filesystem(contextlib.AbstractAsyncContextManager[Any]):
    """An asynchronous fsspec filesystem in this event loop, its connections closed at exit.

    A class, not an ``@asynccontextmanager``: an async generator is also the event loop's to
    finalise. When a worker's close was cut short and left ``loading()`` open, the loop's
    ``shutdown_asyncgens`` closed that generator and this one at once, and the outer one's
    exit then threw into this one while it ran: "athrow(): asynchronous generator is already
    running" (issue 19). Now only its holder closes it, once, after the loads.
    """

    def __init__(self, protocol: str, storage_options: Mapping[str, Any]) -> None:
        self.protocol = protocol
        self.options = with_defaults(protocol, dict(storage_options))
        self._open: Any = None  # the filesystem whose session to close

    async def __aenter__(self) -> Any:
        import fsspec

        protocol, options = self.protocol, self.options
        if not getattr(fsspec.get_filesystem_class(protocol), "async_impl", False):
            # file://, ...: its calls go to threads, nothing to close
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            sync_fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
            return AsyncFileSystemWrapper(sync_fs, asynchronous=True)
        fs = self._open = fsspec.filesystem(protocol, asynchronous=True,
                                            skip_instance_cache=True, **options)
        try:
            await fs.set_session()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        if hasattr(fs, "_s3creator"):
            fs.retries = 1  # s3fs's own loop: up to 5 attempts with sleeps in between
        return fs

    async def __aexit__(self, *exc: object) -> None:
        fs, self._open = self._open, None
        if fs is not None:
            await _close(fs)


def with_defaults(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    if protocol == "s3":
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
        config.setdefault("connect_timeout", CONNECT_TIMEOUT)
        config.setdefault("max_pool_connections", POOL_SIZE)
        options["config_kwargs"] = config
        options.setdefault("max_concurrency", 1)
    elif protocol == "http":
        options.setdefault("get_client", _http_client)
    return options


async def _http_client(**kwargs: Any) -> Any:
    """The aiohttp session of an HTTP filesystem: a short connect timeout, a large pool."""
    import aiohttp

    kwargs.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT,
                                                       sock_read=300))
    if "connector" not in kwargs:
        kwargs["connector"] = aiohttp.TCPConnector(limit=POOL_SIZE)
    return aiohttp.ClientSession(**kwargs)


async def _close(fs: Any) -> None:
    """Close what ``set_session`` opened: s3fs's aiobotocore client, or an aiohttp session."""
    creator = getattr(fs, "_s3creator", None)
    if creator is not None:
        fs._s3 = None
        await creator.__aexit__(None, None, None)
        return
    session, fs._session = getattr(fs, "_session", None), None
    close = getattr(session, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


def fs_path(fs: Any, url: str) -> str:
    """What ``fs`` calls the object (the URL for HTTP, ``bucket/key`` for S3)."""
    return str(fs._strip_protocol(url))


def _full_url(fs: Any, path: str) -> str:
    if "://" in path:
        return path
    return str(fs.unstrip_protocol(path))


async def _expand(fs: Any, spec: str) -> list[str]:
    """The objects ``spec`` names: a glob's matches, a prefix's contents, or the object."""
    path = fs_path(fs, spec)
    http = "http" in _protocols(fs)
    if not _GLOB_CHARS.isdisjoint(path.replace("?", "") if http else path):
        matches = await fs._glob(path, detail=True)
        return [_full_url(fs, p) for p, info in matches.items() if info.get("type") == "file"]
    if http and not spec.endswith("/"):
        await fs._info(path)  # FileNotFoundError if it is not there
        return [spec]
    if not http:
        with contextlib.suppress(FileNotFoundError):
            info = await fs._info(path)
            if info.get("type") == "file":
                return [_full_url(fs, path)]
    return [_full_url(fs, p) for p in await fs._find(path)]


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


async def _nothing_found(fs: Any, spec: str, options: Mapping[str, Any]) -> OSError:
    """Why ``spec`` named no object: its bucket is missing, or nothing matches."""
    where = _endpoint(options)
    if hasattr(fs, "_s3creator"):
        bucket = fs_path(fs, spec).split("/", 1)[0]
        try:
            exists = await fs._exists(bucket)
        except Exception:  # noqa: BLE001 -- the listing's error is the one to report
            exists = True
        if not exists:
            return FileNotFoundError(f"cannot list {spec}: bucket {bucket!r} does not exist"
                                     f"{where} (check the URL and storage_options)")
    return FileNotFoundError(f"cannot list {spec}: no object matches{where}")


def _listing_error(spec: str, exc: Exception, options: Mapping[str, Any]) -> OSError | None:
    """A listing failure as an error naming the URL; None for one to raise as it is."""
    where = _endpoint(options)
    cause = _connection_failure(exc)
    if cause is not None:
        return ConnectionError(f"cannot list {spec}: cannot connect{where} ({cause}; check "
                               "the URL and storage_options)")
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"cannot list {spec}: not found{where} "
                                 "(check the URL and storage_options)")
    if isinstance(exc, PermissionError):
        return PermissionError(f"cannot list {spec}: access denied{where} "
                               "(check the credentials in storage_options)")
    return None


def _endpoint(options: Mapping[str, Any]) -> str:
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url")
    return f" at endpoint {endpoint}" if endpoint else ""


def _connection_failure(exc: BaseException) -> BaseException | None:
    """The connection failure behind ``exc`` (fsspec's HTTP ``_info`` hides it in a
    FileNotFoundError's cause), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_connection_failure(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def _is_connection_failure(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    with contextlib.suppress(ImportError):
        import aiohttp

        if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError)):
            return True
    with contextlib.suppress(ImportError):
        import botocore.exceptions as boto

        if isinstance(exc, (boto.ConnectionError, boto.HTTPClientError)):
            return True
    return False


def transient(exc: Exception, url: str) -> Exception:
    """A botocore transport error as the builtin ConnectionError/TimeoutError; else ``exc``.

    So that the loader's retry policy sees one family of errors whatever the filesystem.
    """
    with contextlib.suppress(ImportError):
        import botocore.exceptions as boto

        if isinstance(exc, (boto.ConnectTimeoutError, boto.ReadTimeoutError)):
            return TimeoutError(f"{url}: {exc}")
        if isinstance(exc, (boto.ConnectionError, boto.HTTPClientError)):
            return ConnectionError(f"{url}: {exc}")
    return exc
