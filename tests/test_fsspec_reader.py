"""FsspecReader on its own: listing (S3, HTTP, files), concurrent loads, faults, fast failures.

The servers (aioloader.testing.object_server and s3_server) run in child processes, one of
each for the module; the loader's integration with the load stage is tested elsewhere (here,
only that workers close the reader's filesystem cleanly).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from aioloader.readers import FsspecReader
from aioloader.testing import ObjectServer, S3Server, object_server, s3_server

pytestmark = pytest.mark.deadline(60)

LATENCY = 0.05
FAULTS = {
    "f503": ["503"],
    "freset": ["reset", "reset"],  # aiohttp resends an idempotent request once by itself
    "ftruncate": ["truncate"],
    "fslow": ["delay:0.2"],
}
EXPLICIT = {name: name.encode() * 1000 for name in FAULTS}
S3_KEYS = {f"train/{i:03d}.bin": bytes([i]) * (100 + i) for i in range(30)}
S3_KEYS["val/a.txt"] = b"val"
CLOSE_CHILD = Path(__file__).parent / "fsspec_close_child.py"


@pytest.fixture(scope="module")
def objects() -> Iterator[ObjectServer]:
    with object_server(EXPLICIT, count=200, size=10_000, seed=7, latency=LATENCY,
                       faults=FAULTS) as server:
        yield server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        keys = list(S3_KEYS.items())
        random.Random(0).shuffle(keys)  # uploaded out of order: the reader sorts
        server.make_bucket("data", dict(keys))
        yield server


def closed_port() -> int:
    """A port nothing listens on (just released: the kernel does not hand it out again soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def tcp_connections() -> int:
    return len(psutil.Process().net_connections(kind="tcp"))


# -- listing -------------------------------------------------------------------------------


async def test_http_listing_is_sorted_and_globs(objects: ObjectServer) -> None:
    every = [objects.object_url(name) for name in objects.names]
    assert every == sorted(every)
    assert await FsspecReader(objects.listing_url).list_urls() == every
    assert await FsspecReader().list_urls(objects.listing_url) == every  # from data_path
    globbed = await FsspecReader(f"{objects.url}/o/00001*.bin").list_urls()
    assert globbed == [objects.object_url(f"{i:06d}.bin") for i in range(10, 20)]
    one = objects.object_url("000003.bin")
    assert [url async for url in FsspecReader(one).read(None)] == [one]


async def test_s3_listing_is_sorted_and_globs(s3: S3Server) -> None:
    train = [f"s3://data/{key}" for key in sorted(S3_KEYS) if key.startswith("train/")]
    options = s3.storage_options
    assert await FsspecReader("s3://data/train/*.bin", storage_options=options).list_urls() == train
    assert await FsspecReader("s3://data/train", storage_options=options).list_urls() == train
    assert await FsspecReader("s3a://data/train/", storage_options=options).list_urls() == train
    everything = await FsspecReader(["s3://data/val/a.txt", "s3://data/train/00*"],
                                    storage_options=options).list_urls()
    assert everything == [*train[:10], "s3://data/val/a.txt"]
    reader = FsspecReader(storage_options=options)
    assert [url async for url in reader.read("s3://data/train/01[0-4].bin")] == train[10:15]


async def test_file_listing(tmp_path: Path) -> None:
    for name in ["b.bin", "a.bin", "c.txt", "sub/d.bin"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    root = tmp_path.as_posix()
    expected = [f"file://{root}/{name}" for name in ["a.bin", "b.bin"]]
    assert await FsspecReader(f"{root}/*.bin").list_urls() == expected
    assert await FsspecReader(f"file://{root}/*.bin").list_urls() == expected
    assert await FsspecReader(root).list_urls() == [
        *expected, f"file://{root}/c.txt", f"file://{root}/sub/d.bin"]
    async with FsspecReader().loading() as load:
        assert (await load(expected[0]))["data"] == b"a.bin"


async def test_listing_nothing_is_a_clear_error(objects: ObjectServer, s3: S3Server,
                                                tmp_path: Path) -> None:
    options = s3.storage_options
    with pytest.raises(FileNotFoundError, match=r"bucket 'nobucket' does not exist at endpoint"):
        await FsspecReader("s3://nobucket/x/*", storage_options=options).list_urls()
    with pytest.raises(FileNotFoundError, match=r"cannot list s3://data/x/\*: no object matches"):
        await FsspecReader("s3://data/x/*", storage_options=options).list_urls()
    with pytest.raises(FileNotFoundError, match=r"cannot list http://.*/o/nothing"):
        await FsspecReader(objects.object_url("nothing")).list_urls()
    with pytest.raises(FileNotFoundError, match="no object matches"):
        await FsspecReader(f"{tmp_path}/*.bin").list_urls()


@pytest.mark.parametrize("scheme", ["s3", "http"])
async def test_unreachable_endpoint_fails_fast(scheme: str) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    if scheme == "s3":
        url = "s3://bucket/x/*"
        reader = FsspecReader(url, storage_options={"endpoint_url": endpoint, "key": "k",
                                                    "secret": "s"})
    else:
        url = f"{endpoint}/o/*"
        reader = FsspecReader(url)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot list {url.replace('*', '.')}"):
        await reader.list_urls()
    assert time.monotonic() - start < 10
    async with reader.loading() as load:
        with pytest.raises((ConnectionError, aiohttp.ClientConnectionError)):
            await load(url.replace("*", "y"))
    assert time.monotonic() - start < 10


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="decode must be callable"):
        FsspecReader("s3://b/x", decode="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no URLs"):
        FsspecReader([])
    with pytest.raises(ValueError, match="several protocols"):
        asyncio.run(FsspecReader(["s3://b/x", "http://h/x"]).list_urls())


# -- loading -------------------------------------------------------------------------------


async def test_loads_overlap(objects: ObjectServer) -> None:
    names = [f"{i:06d}.bin" for i in range(100)]
    async with FsspecReader().loading() as load:
        await load(objects.object_url(names[0]))  # the session is open
        start = time.monotonic()
        instances = await asyncio.gather(*(load(objects.object_url(n)) for n in names))
        elapsed = time.monotonic() - start
    assert elapsed < 25 * LATENCY, f"100 loads of {LATENCY}s took {elapsed:.2f}s: serialised?"
    for name, instance in zip(names, instances, strict=True):
        assert instance == {"url": objects.object_url(name), "data": objects.expected(name)}


async def test_s3_loads_and_decode(s3: S3Server) -> None:
    reader = FsspecReader("s3://data/train/*", storage_options=s3.storage_options,
                          decode=_length)
    urls = await reader.list_urls()
    async with reader.loading() as load:
        lengths = await asyncio.gather(*(load(url) for url in urls))
        with pytest.raises(FileNotFoundError):
            await load("s3://data/train/missing.bin")
    assert lengths == [(url, len(S3_KEYS[url.removeprefix("s3://data/")])) for url in urls]
    async with FsspecReader(storage_options=s3.storage_options).loading() as load:
        assert (await load("s3://data/val/a.txt"))["data"] == b"val"
    with pytest.raises(RuntimeError, match=r"loading\(\) context has exited"):
        await load("s3://data/val/a.txt")


def _length(url: str, data: bytes) -> tuple[str, int]:
    return url, len(data)


async def test_faults_surface_as_exceptions(objects: ObjectServer) -> None:
    before = objects.requests()
    async with FsspecReader().loading() as load:
        with pytest.raises(aiohttp.ClientResponseError) as error:
            await load(objects.object_url("f503"))
        assert error.value.status == 503
        with pytest.raises(aiohttp.ClientConnectionError):
            await load(objects.object_url("freset"))
        with pytest.raises(aiohttp.ClientPayloadError):
            await load(objects.object_url("ftruncate"))
        start = time.monotonic()
        slow = await load(objects.object_url("fslow"))
        assert time.monotonic() - start >= 0.2
        # Each plan is spent: the next attempt gets the object (the loader's retry would).
        for name in FAULTS:
            assert (await load(objects.object_url(name)))["data"] == EXPLICIT[name]
    assert slow["data"] == EXPLICIT["fslow"]
    attempts = {name: objects.requests()[name] - before.get(name, 0) for name in FAULTS}
    assert attempts == {"f503": 2, "freset": 3, "ftruncate": 2, "fslow": 2}


@pytest.mark.parametrize("where", ["http", "s3"])
async def test_loading_closes_its_connections(where: str, objects: ObjectServer,
                                              s3: S3Server) -> None:
    if where == "http":
        reader, urls = FsspecReader(), [objects.object_url(n) for n in objects.names[:20]]
    else:
        reader = FsspecReader(storage_options=s3.storage_options)
        urls = [f"s3://data/{key}" for key in list(S3_KEYS)[:20]]
    await reader.list_urls(urls)  # listing opens and closes its own
    before, fds = tcp_connections(), psutil.Process().num_fds()
    async with reader.loading() as load:
        await asyncio.gather(*(load(url) for url in urls))
        if where == "http":  # kept alive (moto's server closes each connection itself)
            assert tcp_connections() > before
    await asyncio.sleep(0)  # the transports close on the loop's next turn
    assert (tcp_connections(), psutil.Process().num_fds()) == (before, fds)


@pytest.mark.deadline(150)
def test_workers_close_their_http_filesystem_cleanly(tmp_path: Path) -> None:
    """Over HTTP, 2 workers, concurrency 32, closed with loads in flight: 12 times (20 took
    57 s of CI's time under load), and no worker writes to stderr (issue 19: a worker whose
    close was cut short by the parent's EOF left its loading() context to the loop's
    shutdown_asyncgens, which finalised it and the filesystem generator inside it at once:
    "athrow(): asynchronous generator is already running", the session closed out of
    order)."""
    with object_server(count=2000, size=2_000) as server, \
            (tmp_path / "stderr").open("w+") as stderr:
        urls = [server.object_url(name) for name in server.names]
        done = subprocess.run([sys.executable, str(CLOSE_CHILD), "12"], input=json.dumps(urls),
                              stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=120,
                              check=False)
        stderr.seek(0)
        written = stderr.read()
    runs = [tuple(map(int, line.split())) for line in done.stdout.splitlines()]
    dirty = [run for run, nbytes in runs if nbytes]
    assert written == "", f"runs {dirty} of 12 wrote to stderr:\n{written[-4000:]}"
    assert done.returncode == 0 and [run for run, _ in runs] == list(range(1, 13)), done


def test_reader_pickles_without_state(s3: S3Server) -> None:
    reader = FsspecReader("s3://data/train/*", storage_options=s3.storage_options,
                          decode=_length)
    copy = pickle.loads(pickle.dumps(reader))
    assert repr(copy) == repr(reader)
    assert asyncio.run(copy.list_urls()) == asyncio.run(reader.list_urls())


# -- the servers ---------------------------------------------------------------------------


def test_servers_stop_their_processes() -> None:
    with object_server({"x": b"1"}) as objects, s3_server() as s3:
        children = {p.pid for p in psutil.Process().children(recursive=True)}
        assert {objects.pid, s3.pid} <= children
        assert objects.requests() == {}
    assert not psutil.pid_exists(objects.pid) and not psutil.pid_exists(s3.pid)


def test_object_server_checks_its_fault_plan() -> None:
    with pytest.raises(ValueError, match="fault 'boom' for 'x'"), object_server(
            faults={"x": ["boom"]}):
        pass

