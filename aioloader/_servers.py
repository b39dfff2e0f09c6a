"""Local servers for tests, benchmarks and examples: an HTTP object store with faults, and S3.

Each runs in a child process on 127.0.0.1, on a port the child binds itself (no race for a
free port). The parent sends the configuration on the child's stdin, length-prefixed, and
keeps stdin open as a lifeline: the child stops when it reads EOF there, so it also stops if
the parent dies. The child reports ``READY <port>`` on stdout; the parent waits on that pipe
with a deadline. Stopping closes the lifeline, then terminates and kills within bounds.

Examples:
    >>> from aioloader.testing import object_server
    >>> with object_server({"a.txt": b"hello"}) as server:  # doctest: +SKIP
    ...     import urllib.request
    ...     urllib.request.urlopen(server.object_url("a.txt")).read()
    b'hello'
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import html
import importlib.util
import json
import os
import pickle
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from aiohttp import web

READY_TIMEOUT = 60.0  # seconds for a child to start: moto imports a lot on a busy machine
STOP_TIMEOUT = 5.0  # for each step of stopping: lifeline closed, terminate, kill
REGION = "us-east-1"
POOL_SIZE = 4 << 20  # bytes of randomness that generated objects are sliced from
CREDENTIALS = {"key": "testing", "secret": "testing"}
_HEADER = struct.Struct("!Q")  # the length of the pickled configuration on stdin
# What each server needs installed (its child's imports, and the client make_bucket uses),
# and the extra of pyproject.toml that brings it.
NEEDS = {"objects": (("aiohttp",), "remote"), "s3": (("moto", "werkzeug", "boto3"), "s3-local")}


class ServerStartError(RuntimeError):
    """A server's child process exited or stayed silent before it reported readiness, or
    what it needs is not installed (the message says which extra brings it)."""


def _check_installed(mode: str) -> None:
    """Fail at once, naming the extra to install, rather than with the child's ImportError."""
    modules, extra = NEEDS[mode]
    missing = [name for name in modules if not _installed(name)]
    if missing:
        raise ServerStartError(
            f"the {mode} server needs {', '.join(missing)}, which is not installed: in a clone "
            f"of aioloader, pip install -e \".[{extra}]\" -c constraints.txt")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, a broken __spec__
        return False


def expected_object(name: str, size: int, seed: int = 0) -> bytes:
    """The bytes the object server generates for ``name``: pseudo-random, from name and seed.

    A slice of a random pool made once per seed, at an offset hashed from the name: cheap
    enough for thousands of objects a second (generating 100 kB afresh is ~0.4 ms).

    Examples:
        >>> expected_object("000001.bin", 8) == expected_object("000001.bin", 8)
        True
        >>> len(expected_object("x", 100))
        100
    """
    pool = _pool(seed)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    offset = int.from_bytes(digest, "big") % len(pool)
    if offset + size <= len(pool):
        return pool[offset:offset + size]
    repeats = (offset + size) // len(pool) + 1
    return (pool * repeats)[offset:offset + size]


@functools.lru_cache(maxsize=4)
def _pool(seed: int) -> bytes:
    return random.Random(seed).randbytes(POOL_SIZE)


def generated_name(index: int) -> str:
    """The name of the ``index``-th generated object: ``000042.bin``."""
    return f"{index:06d}.bin"


def _check_faults(faults: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    plan = {str(name): list(steps) for name, steps in faults.items()}
    for name, steps in plan.items():
        for step in steps:
            ok = step in ("ok", "reset", "truncate") or (step.isdigit() and len(step) == 3)
            if step.startswith("delay:"):
                with contextlib.suppress(ValueError):
                    ok = float(step[len("delay:"):]) >= 0
            if not ok:
                raise ValueError(f"fault {step!r} for {name!r}: use 'ok', 'reset', 'truncate', "
                                 "an HTTP status such as '503', or 'delay:SECONDS'")
    return plan


@dataclass(frozen=True)
class ObjectServer:
    """A running object server: objects at ``{url}/o/<name>``, a listing at ``{url}/o/``."""

    url: str
    names: tuple[str, ...]  # every object served, sorted
    size: int  # of the generated objects
    seed: int
    pid: int
    objects: Mapping[str, bytes] = field(repr=False)  # the explicit ones

    @property
    def listing_url(self) -> str:
        """An HTML page linking every object (fsspec's HTTPFileSystem lists and globs it)."""
        return f"{self.url}/o/"

    def object_url(self, name: str) -> str:
        return f"{self.url}/o/{urllib.parse.quote(name)}"

    def expected(self, name: str) -> bytes:
        """The bytes served for ``name`` (when no fault is injected)."""
        if name in self.objects:
            return self.objects[name]
        return expected_object(name, self.size, self.seed)

    def requests(self) -> dict[str, int]:
        """Requests received per object name so far, every attempt and method counted."""
        with urllib.request.urlopen(f"{self.url}/_stats", timeout=10) as response:
            counts: dict[str, int] = json.load(response)["requests"]
        return counts


@dataclass(frozen=True)
class S3Server:
    """A running moto S3 server."""

    endpoint_url: str
    pid: int

    @property
    def storage_options(self) -> dict[str, Any]:
        """For s3fs / ``FsspecReader(storage_options=...)``; a fresh dict each time."""
        return {"endpoint_url": self.endpoint_url, **CREDENTIALS,
                "client_kwargs": {"region_name": REGION}}

    def client(self) -> Any:
        """A boto3 S3 client for this server; close it (``contextlib.closing``)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=CREDENTIALS["key"],
                            aws_secret_access_key=CREDENTIALS["secret"])

    def make_bucket(self, name: str, objects: Mapping[str, bytes] | None = None) -> None:
        """Create bucket ``name`` holding ``objects`` (key -> bytes)."""
        with contextlib.closing(self.client()) as s3:
            s3.create_bucket(Bucket=name)
            for key, data in (objects or {}).items():
                s3.put_object(Bucket=name, Key=key, Body=data)


@contextlib.contextmanager
def object_server(objects: Mapping[str, bytes] | None = None, *, count: int = 0,
                  size: int = 100_000, seed: int = 0, latency: float = 0.0,
                  faults: Mapping[str, Sequence[str]] | None = None) -> Iterator[ObjectServer]:
    """An HTTP object server in a child process, for as long as the block runs.

    Serves ``objects`` (name -> bytes) and ``count`` generated objects named
    :func:`generated_name` (``000000.bin``, ...) whose bytes are
    :func:`expected_object` ``(name, size, seed)``, made on demand. Every request waits
    ``latency`` seconds (``asyncio.sleep``: requests overlap). ``faults`` maps a name to what
    its successive requests get, one step each, then success: ``"503"`` (any HTTP status),
    ``"reset"`` (the connection is reset), ``"truncate"`` (half the body, then the connection
    closes), ``"delay:2.0"`` (2 s more latency, then the object), ``"ok"``. A ``Range``
    header gets those bytes (206), as object stores answer ranged reads.

    Examples:
        >>> with object_server(count=10, faults={"000003.bin": ["503"]}) as server:
        ...     server.names[:2]
        ('000000.bin', '000001.bin')
    """
    if count < 0 or size < 0 or latency < 0:
        raise ValueError(f"count, size and latency must be >= 0, got {count}, {size}, {latency}")
    explicit = {str(name): bytes(data) for name, data in (objects or {}).items()}
    config = {"objects": explicit, "count": count, "size": size, "seed": seed,
              "latency": float(latency), "faults": _check_faults(faults or {})}
    names = tuple(sorted({*explicit, *(generated_name(i) for i in range(count))}))
    with _child("objects", config) as (pid, port):
        yield ObjectServer(f"http://127.0.0.1:{port}", names, size, seed, pid, explicit)


@contextlib.contextmanager
def s3_server(*, latency: float = 0.0) -> Iterator[S3Server]:
    """A moto S3 server in a child process, for as long as the block runs.

    Every request waits ``latency`` seconds before moto answers it (each request has its
    own thread: requests overlap), as an object store's round trip does.

    Examples:
        >>> with s3_server() as s3:  # doctest: +SKIP
        ...     s3.make_bucket("data", {"train/0.bin": b"..."})
        ...     FsspecReader("s3://data/train/*", storage_options=s3.storage_options)
    """
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency}")
    env = {"AWS_ACCESS_KEY_ID": CREDENTIALS["key"], "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"],
           "AWS_DEFAULT_REGION": REGION}
    with _child("s3", {"latency": float(latency)}, env) as (pid, port):
        yield S3Server(f"http://127.0.0.1:{port}", pid)


@contextlib.contextmanager
def _child(mode: str, config: dict[str, Any],
           env: dict[str, str] | None = None) -> Iterator[tuple[int, int]]:
    """``python -m aioloader._servers MODE``, configured and ready: yields (pid, port)."""
    _check_installed(mode)
    payload = pickle.dumps(config)
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([sys.executable, "-m", "aioloader._servers", mode],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                env={**os.environ, **(env or {})})
        try:
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(_HEADER.pack(len(payload)) + payload)
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it exited already: _wait_ready reports why
            port = _wait_ready(proc, proc.stdout, errors, mode)
            yield proc.pid, port
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], stdout: IO[bytes], errors: IO[bytes],
                mode: str) -> int:
    """The port from the child's ``READY <port>`` line, read with a deadline."""
    deadline = time.monotonic() + READY_TIMEOUT
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        readable = select.select([stdout], [], [], max(left, 0))[0] if left > 0 else []
        chunk = os.read(stdout.fileno(), 256) if readable else b""
        if not chunk:
            why = "exited" if readable else f"did not report readiness in {READY_TIMEOUT:.0f}s"
            proc.kill()
            proc.wait()
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-4000:]
            raise ServerStartError(f"the {mode} server {why} (exit code {proc.returncode}); "
                                   f"its stderr:\n{tail}")
        line += chunk
    word, _, port = line.decode().strip().partition(" ")
    if word != "READY" or not port.isdigit():
        raise ServerStartError(f"the {mode} server said {line!r}, not 'READY <port>'")
    return int(port)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Close the lifeline, then terminate, then kill, each waited for with a bound."""
    with contextlib.suppress(OSError):
        assert proc.stdin is not None
        proc.stdin.close()
    for step in (None, proc.terminate, proc.kill):
        if step is not None:
            step()
        try:
            proc.wait(STOP_TIMEOUT)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


# -- the child processes ------------------------------------------------------------------


def _read_config() -> dict[str, Any]:
    """The pickled configuration from stdin, exactly its bytes: the rest is the lifeline."""

    def read_exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                raise SystemExit("stdin closed before the configuration arrived")
            data += chunk
        return data

    (length,) = _HEADER.unpack(read_exactly(_HEADER.size))
    config: dict[str, Any] = pickle.loads(read_exactly(length))
    return config


def _report_ready(port: int) -> None:
    os.write(1, f"READY {port}\n".encode())


def _serve_objects(config: dict[str, Any]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(_objects_main(config))
    else:
        uvloop.run(_objects_main(config))


async def _objects_main(config: dict[str, Any]) -> None:
    from aiohttp import web

    objects: dict[str, bytes] = config["objects"]
    count, size, seed = config["count"], config["size"], config["seed"]
    latency: float = config["latency"]
    faults: dict[str, list[str]] = config["faults"]
    names = sorted({*objects, *(generated_name(i) for i in range(count))})
    generated = {generated_name(i) for i in range(count)}
    requests: Counter[str] = Counter()

    def lookup(name: str) -> bytes | None:
        if name in objects:
            return objects[name]
        return expected_object(name, size, seed) if name in generated else None

    def listing(prefix: str) -> web.Response:
        links = "".join(f'<a href="/o/{urllib.parse.quote(n)}">{html.escape(n)}</a><br>\n'
                        for n in names if n.startswith(prefix))
        return web.Response(text=f"<html><body>\n{links}</body></html>\n",
                            content_type="text/html")

    async def get_object(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if not name or name.endswith("/"):
            return listing(name)
        attempt = requests[name]
        requests[name] += 1
        plan = faults.get(name, ())
        step = plan[attempt] if attempt < len(plan) else "ok"
        delay = latency + (float(step[len("delay:"):]) if step.startswith("delay:") else 0.0)
        if delay:
            await asyncio.sleep(delay)
        body = lookup(name)
        if step.isdigit():
            return web.Response(status=int(step), text=f"injected {step} for {name}\n")
        if body is None:
            return web.Response(status=404, text=f"no object {name}\n")
        if step == "reset":
            return _reset(request)
        if step == "truncate":
            return await _truncate(request, body)
        wanted = request.http_range  # a Range header: the bytes asked for (206)
        if wanted.start is not None or wanted.stop is not None:
            first = wanted.start or 0
            part = body[wanted]
            return web.Response(status=206, body=part, content_type="application/octet-stream",
                                headers={"Content-Range": f"bytes {first}-"
                                         f"{first + len(part) - 1}/{len(body)}"})
        return web.Response(body=body, content_type="application/octet-stream")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"requests": dict(requests)})

    app = web.Application()
    app.router.add_get("/_stats", stats)
    app.router.add_get("/o/{name:.*}", get_object)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    site = web.SockSite(runner, sock)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_lifeline() -> None:
        if not os.read(0, 4096):  # EOF: the parent closed it, or died
            stop.set()

    loop.add_reader(0, on_lifeline)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    _report_ready(sock.getsockname()[1])
    try:
        await stop.wait()
    finally:
        loop.remove_reader(0)
        await runner.cleanup()


def _reset(request: web.Request) -> NoReturn:
    """Reset the connection: SO_LINGER 0 makes close() send RST instead of FIN."""
    from aiohttp import web

    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if transport is not None:
        transport.abort()
    raise web.HTTPInternalServerError()  # never sent: the connection is gone


async def _truncate(request: web.Request, body: bytes) -> web.StreamResponse:
    """Announce the whole body, send half of it, close the connection."""
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[:len(body) // 2])
    request.protocol.force_close()
    if request.transport is not None:
        request.transport.close()
    return response


def _serve_s3(config: dict[str, Any]) -> None:
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app: Any = DomainDispatcherApplication(create_backend_app)
    latency: float = config.get("latency", 0.0)
    if latency:
        app = _delayed(app, latency)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    os.environ["MOTO_PORT"] = str(server.server_port)
    thread = threading.Thread(target=server.serve_forever, name="moto", daemon=True)
    thread.start()
    _report_ready(server.server_port)
    while os.read(0, 4096):  # until the lifeline closes
        pass
    server.shutdown()
    thread.join(STOP_TIMEOUT)
    server.server_close()


def _delayed(app: Any, latency: float) -> Any:
    """The WSGI ``app`` answering each request ``latency`` seconds late (a simulated round
    trip: the request's own server thread waits, others go on)."""

    def delayed(environ: dict[str, Any], start_response: Any) -> Any:
        time.sleep(latency)
        return app(environ, start_response)

    return delayed


def main(argv: list[str]) -> None:
    if argv not in (["objects"], ["s3"]):
        raise SystemExit("usage: python -m aioloader._servers objects|s3 "
                         "(configuration on stdin; started by aioloader.testing)")
    config = _read_config()
    if argv == ["objects"]:
        _serve_objects(config)
    else:
        _serve_s3(config)


if __name__ == "__main__":
    main(sys.argv[1:])
