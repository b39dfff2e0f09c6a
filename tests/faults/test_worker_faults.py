"""Cases 1 and 2: a worker raises, or dies without a word.

The matrix: how the worker fails x how the consumer consumes (async for / sync for) x
(num_workers, cached or lazy plan, start method). Every case must end in a WorkerError
naming the worker, quickly, with every worker reaped (the autouse leak check).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
import victims
from fault_helpers import consume, survivors

import aioloader
from aioloader.testing import KillingReader

# (num_workers, max_instances_in_memory, start_method): cached mode reads the data through
# workers once ("instances" plan), then fetches batches by index; lazy mode streams batches.
SETUPS = [
    pytest.param(1, None, "fork", id="w1-cached-fork"),
    pytest.param(2, 8, "fork", id="w2-lazy-fork"),
]
CONSUMERS = ["async", "sync"]
# Spawned workers import torch (seconds each on 2 cores): a few cells of the matrix only.
SPAWN_CELLS = [
    pytest.param("read", "async", 2, 8, id="raise-read-async-w2-lazy"),
    pytest.param("collate", "sync", 1, None, id="raise-collate-sync-w1-cached"),
    pytest.param("exit", "sync", 2, None, id="die-exit-sync-w2-cached"),
    pytest.param("sigkill", "async", 2, 8, id="die-sigkill-async-w2-lazy"),
]

LATENCY_BOUND = 10.0  # the issue asks for 2 s; a busy 2-core CI box gets slack


def _raising_source(where: str) -> tuple[Any, dict[str, Any], str]:
    """(source, extra loader kwargs, the function name the traceback must show)."""
    if where == "read":
        return victims.ExplodingReader(20, fail_at=5), {}, "explode_in_read"
    if where == "async_read":
        return victims.AsyncExplodingReader(20, fail_at=5), {}, "explode_in_async_read"
    if where == "collate":
        return (victims.PlainReader(20), {"collate_fn": victims.explode_in_collate},
                "explode_in_collate")
    raise AssertionError(where)


def _run_until_error(loader: aioloader.DataLoader, consumer: str) -> tuple[BaseException, float]:
    t0 = time.monotonic()
    with pytest.raises(aioloader.WorkerError) as info:
        consume(loader, consumer)
    return info.value, time.monotonic() - t0


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize(("workers", "lazy", "method"), SETUPS)
@pytest.mark.parametrize("where", ["read", "async_read", "collate"])
def test_worker_raises(where: str, workers: int, lazy: int | None, method: str,
                       consumer: str) -> None:
    source, extra, func = _raising_source(where)
    loader = aioloader.DataLoader(source, batch_size=2, num_workers=workers,
                                  max_instances_in_memory=lazy, start_method=method,
                                  quiet=True, **extra)
    err, _ = _run_until_error(loader, consumer)
    msg = str(err)
    raised_at = re.search(r" at (\d+\.\d+)", msg)
    assert raised_at, msg
    elapsed = time.time() - float(raised_at.group(1))
    print(f"\nLATENCY worker-raises {where} {consumer} w{workers} {method}: "
          f"{elapsed:.2f}s from the raise to WorkerError")
    assert func in msg, msg
    assert re.search(r"worker \d+ \(pid \d+\) raised", msg), msg
    assert "Traceback" in msg, msg
    assert not isinstance(err, aioloader.WorkerDied)
    assert err.worker_id is not None and err.pid is not None  # type: ignore[attr-defined]
    assert elapsed < LATENCY_BOUND
    assert not survivors(deadline=5.0), "workers outlived the WorkerError"


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize(("workers", "lazy", "method"), SETUPS)
@pytest.mark.parametrize("how", ["exit", "sigkill", "segv", "oom"])
def test_worker_dies(how: str, workers: int, lazy: int | None, method: str, consumer: str,
                     tmp_path: Any) -> None:
    stamp = tmp_path / "died-at"
    reader = KillingReader(40, die_at=9, how=how, worker=workers - 1,  # type: ignore[arg-type]
                           stamp_file=str(stamp))
    loader = aioloader.DataLoader(reader, batch_size=2, num_workers=workers,
                                  max_instances_in_memory=lazy, start_method=method,
                                  quiet=True)
    err, _ = _run_until_error(loader, consumer)
    latency = time.time() - float(stamp.read_text())
    msg = str(err)
    print(f"\nLATENCY worker-dies {how} {consumer} w{workers} {method}: "
          f"{latency:.2f}s from the death to WorkerError")
    wid = workers - 1
    assert f"worker {wid} (pid {err.pid})" in msg, msg  # type: ignore[attr-defined]
    assert err.worker_id == wid  # type: ignore[attr-defined]
    if how == "exit":
        assert isinstance(err, aioloader.WorkerDied)
        assert "exit code 3" in msg, msg
    elif how == "sigkill":
        assert isinstance(err, aioloader.WorkerDied)
        assert "signal 9 (SIGKILL)" in msg, msg
    elif how == "segv":
        assert isinstance(err, aioloader.WorkerDied)
        assert "signal 11 (SIGSEGV)" in msg, msg
    else:  # a memory limit: the allocation fails inside the worker
        assert "MemoryError" in msg, msg
    assert latency < LATENCY_BOUND
    assert not survivors(deadline=5.0), "workers outlived the WorkerError"


@pytest.mark.parametrize(("fault", "consumer", "workers", "lazy"), SPAWN_CELLS)
def test_spawn(fault: str, consumer: str, workers: int, lazy: int | None,
               tmp_path: Any) -> None:
    if fault in ("read", "collate"):
        test_worker_raises(fault, workers, lazy, "spawn", consumer)
    else:
        test_worker_dies(fault, workers, lazy, "spawn", consumer, tmp_path)


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_loader_usable_after_worker_error(consumer: str) -> None:
    """After a WorkerError the same loader starts fresh workers for the next epoch."""
    reader = victims.ExplodingReader(20, fail_at=5)
    loader = aioloader.DataLoader(reader, batch_size=2, num_workers=2,
                                  max_instances_in_memory=8, quiet=True)
    for _ in range(2):
        with pytest.raises(aioloader.WorkerError, match="explode_in_read"):
            consume(loader, consumer)
    reader.fail_at = -1  # fork: the next session's workers see the healed reader
    batches = consume(loader, consumer)
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(20))


def test_no_workers_raise_the_original_exception() -> None:
    """num_workers=0: nothing crosses a process boundary; the reader's own error surfaces."""
    loader = aioloader.DataLoader(victims.ExplodingReader(20, fail_at=5), batch_size=2,
                                  quiet=True)
    with pytest.raises(KeyError, match="explode_in_read"):
        asyncio.run(asyncio.wait_for(_drain(loader), 30))


async def _drain(loader: aioloader.DataLoader) -> None:
    async for _ in loader:
        pass
