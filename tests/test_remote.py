"""The load stage against real servers on 127.0.0.1 (issue 11): an S3 server (moto) and an
HTTP object server that injects latency and faults, both started by these tests.

Every key exactly once (in order when ordered) under faults with retries; skipped keys
reported; a close with 100 loads in flight leaves no task, socket, process or fd; an
unreachable endpoint or a missing bucket fails fast, naming the URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import aioloader
from aioloader import Retry
from aioloader.readers import FsspecReader
from aioloader.testing import ObjectServer, S3Server, object_server, s3_server

N = 120
FAULTS = {  # object name -> what its first requests get, in order
    **{f"{i:06d}.bin": ["503"] for i in range(0, N, 7)},
    **{f"{i:06d}.bin": ["reset", "reset", "500"] for i in range(3, N, 11)},
    **{f"{i:06d}.bin": ["truncate", "503"] for i in range(5, N, 13)},
    **{f"{i:06d}.bin": ["delay:5", "ok"] for i in range(6, N, 17)},
}
PERMANENT = {f"{i:06d}.bin": ["404"] * 50 for i in (10, 40)}


def _name(url: str, data: bytes) -> dict[str, Any]:
    return {"name": url.rsplit("/", 1)[1], "size": len(data)}


@pytest.fixture()
def flaky() -> Iterator[ObjectServer]:  # fault plans get used up: one server a test
    with object_server(count=N, size=2_000, latency=0.005, faults=FAULTS) as server:
        yield server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        server.make_bucket("shards", {f"train/{i:04d}.bin": f"{i:04d}.bin".encode() * 50
                                      for i in range(61)})
        yield server


def names(loader: aioloader.DataLoader) -> list[str]:
    return [n for batch in loader for n in batch["name"]]


@pytest.mark.deadline(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_key_once_and_in_order_under_faults_with_retries(
        flaky: ObjectServer, num_workers: int) -> None:
    urls = [flaky.object_url(n) for n in flaky.names]
    loader = aioloader.DataLoader(
        FsspecReader(urls, decode=_name), batch_size=8, num_workers=num_workers,
        concurrency=16, retries=Retry(4, backoff=0.01, timeout=1.0), quiet=True)
    got = [(n, s) for b in loader for n, s in zip(b["name"], b["size"].tolist(), strict=True)]
    want = sorted(flaky.names)
    if num_workers == 0:
        assert [n for n, _ in got] == want  # exactly once, in key order
    else:
        assert sorted(n for n, _ in got) == want  # exactly once; shards round-robin
        shard = [n for n, _ in got if int(n[:6]) % 2 == 0]
        assert shard == sorted(shard)  # each worker's keys in order
    assert all(size == 2_000 for _, size in got)  # no truncated body got through
    requests = flaky.requests()
    failing = {n: sum(step != "ok" for step in plan) for n, plan in FAULTS.items()}
    wrong = {n: (requests.get(n), k + 1) for n, k in failing.items() if requests.get(n) != k + 1}
    assert not wrong, wrong  # each fault cost one attempt: retried, then loaded once
    assert loader.skipped == []


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_reports_the_keys_that_keep_failing(num_workers: int,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with object_server(count=50, size=100, faults=PERMANENT) as server:
        urls = [server.object_url(n) for n in server.names]
        loader = aioloader.DataLoader(FsspecReader(urls, decode=_name), batch_size=5,
                                      num_workers=num_workers, concurrency=8,
                                      retries=Retry(2, backoff=0.01), on_error="skip",
                                      quiet=True)
        with caplog.at_level(logging.WARNING, logger="aioloader"):
            got = names(loader)
        loader.close()
    assert sorted(got) == [n for n in server.names if n not in PERMANENT]
    assert {s.key for s in loader.skipped} == {server.object_url(n) for n in PERMANENT}
    assert all(s.attempts == 1 for s in loader.skipped)  # a 404 is not transient
    assert all("FileNotFoundError" in s.error for s in loader.skipped), loader.skipped
    assert sum("skipped key" in r.getMessage() for r in caplog.records) == len(loader.skipped)


@pytest.mark.deadline(180)
def test_the_s3_reader_reads_a_bucket_across_2_ranks_and_2_workers_exactly_once(
        s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "scripts_issue9"))
    import issue9_dist
    import remote_dist

    monkeypatch.setenv(remote_dist.S3_ENV, json.dumps(s3.storage_options))
    ranks = issue9_dist.run_ranks(tmp_path, list(remote_dist.CASES), deadline=150,
                                  registry="remote_dist")
    per_rank = [ranks[r]["s3_two_workers"] for r in (0, 1)]
    for r, got in enumerate(per_rank):
        assert "error" not in got, f"rank {r}: {got['error']}"
    want = [f"{i:04d}.bin" for i in range(61)]
    for epoch in (0, 1):
        seen = [n for got in per_rank for n in got["epochs"][epoch]]
        assert sorted(seen) == want, epoch  # every object once, across ranks and workers
    assert set(per_rank[0]["epochs"][0]).isdisjoint(per_rank[1]["epochs"][0])


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_close_with_100_loads_in_flight_leaves_nothing(num_workers: int) -> None:
    hang = {f"{i:06d}.bin": ["delay:600"] for i in range(400)}
    with object_server(count=400, size=100, faults=hang) as server:
        urls = [server.object_url(n) for n in server.names]
        me = psutil.Process()

        async def main() -> None:
            tasks = asyncio.all_tasks()
            servers = {c.pid for c in me.children()}
            loader = aioloader.DataLoader(FsspecReader(urls), batch_size=10,
                                          num_workers=num_workers,
                                          concurrency=100 // max(num_workers, 1), quiet=True)
            consumer = asyncio.ensure_future(_first(loader))
            while sum(server.requests().values()) < 100:  # the server counts what arrived
                await asyncio.sleep(0.05)
                assert not consumer.done(), consumer
            assert sum(server.requests().values()) == 100  # the window, no more
            began = time.monotonic()
            await loader.aclose()
            assert time.monotonic() - began < 10  # promptly, not after a grace period
            with pytest.raises(aioloader.LoaderClosedError):
                await consumer
            assert asyncio.all_tasks() == tasks
            assert _tcp_to(me, server.url) == 0  # every connection closed
            assert {c.pid for c in me.children()} <= servers  # the workers are gone

        asyncio.run(main())


def _tcp_to(me: psutil.Process, url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    return sum(1 for c in me.net_connections(kind="tcp") if c.raddr and c.raddr.port == port)


async def _first(loader: aioloader.DataLoader) -> Any:
    async for batch in loader:
        return batch
    return None


@pytest.mark.deadline(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_unreachable_endpoint_fails_fast_naming_the_url(num_workers: int) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"}
    loader = aioloader.DataLoader(FsspecReader("s3://bucket/train/*", storage_options=options),
                                  batch_size=4, num_workers=num_workers, concurrency=8,
                                  retries=3, quiet=True)
    began = time.monotonic()
    with pytest.raises(Exception) as info:
        list(loader)
    assert time.monotonic() - began < 20
    text = str(info.value)
    assert "s3://bucket/train/*" in text and f"127.0.0.1:{port}" in text, text


@pytest.mark.deadline(60)
def test_a_missing_bucket_fails_fast_naming_it(s3: S3Server) -> None:
    loader = aioloader.DataLoader(FsspecReader("s3://nobucket/x/*",
                                               storage_options=s3.storage_options),
                                  batch_size=4, num_workers=2, quiet=True)
    began = time.monotonic()
    with pytest.raises(aioloader.WorkerError, match="bucket 'nobucket' does not exist"):
        list(loader)
    assert time.monotonic() - began < 20


@pytest.mark.deadline(120)
def test_a_lazy_s3_loader_resumes_exactly(s3: S3Server) -> None:
    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(
            FsspecReader("s3://shards/train/*.bin", storage_options=s3.storage_options,
                         decode=_name),
            batch_size=4, shuffle=True, seed=2, num_workers=2, concurrency=8,
            max_instances_in_memory=8, quiet=True)

    with make() as whole:
        want = names(whole)
    with make() as part:
        got = []
        for batch in part:
            got += batch["name"]
            if len(got) == 20:
                break
        state = json.dumps(part.state_dict())
    with make() as rest:
        rest.load_state_dict(json.loads(state))
        got += names(rest)
    assert got == want
