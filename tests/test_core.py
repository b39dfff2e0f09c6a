"""Core behaviour: workers x start methods x reader kinds, the arena, the loop, bad input."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

import aioloader
from aioloader.testing import _own_shm

sys.path.insert(0, str(Path(__file__).parent))
import core_sources as S


def indices(batches: list[dict]) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


async def collect(loader: aioloader.DataLoader, timeout: float = 120) -> list:
    async def run() -> list:
        return [b async for b in loader]

    return await asyncio.wait_for(run(), timeout)


@pytest.mark.parametrize("reader", [S.SyncReader, S.AsyncReader])
@pytest.mark.parametrize("lazy", [None, 8])
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
async def test_every_instance_once_in_every_configuration(num_workers, start_method, lazy,
                                                          reader):
    if num_workers == 0 and start_method == "spawn":
        pytest.skip("no workers: the start method plays no part")
    loader = aioloader.DataLoader(reader(30), batch_size=4, num_workers=num_workers,
                                  start_method=start_method, max_instances_in_memory=lazy,
                                  quiet=True)
    async with loader:
        for _ in range(2):
            batches = await collect(loader)
            assert sorted(indices(batches)) == list(range(30))
            for b in batches:
                assert torch.equal(b["x"], torch.stack([b["index"], b["index"] * 2], 1))
            pids = {p for b in batches for p in b["pid"].tolist()}
            assert (os.getpid() in pids) == (num_workers == 0)
        sync_batches = list(loader)
        assert sorted(indices(sync_batches)) == list(range(30))


@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style_batches_do_not_depend_on_num_workers(shuffle):
    def run(nw: int) -> list[list[int]]:
        with aioloader.DataLoader(S.Squares(37), batch_size=5, num_workers=nw, shuffle=shuffle,
                                  seed=11, quiet=True) as loader:
            return [[b["index"].tolist() for b in loader] for _ in range(2)]

    reference = run(0)
    assert run(1) == reference
    assert run(2) == reference
    if shuffle:
        assert reference[0] != reference[1], "each epoch is reshuffled"


def test_same_seed_same_batches_other_seed_other_batches():
    def run(seed: int) -> list[list[int]]:
        loader = aioloader.DataLoader(S.SyncReader(40), batch_size=4, shuffle=True, seed=seed,
                                      num_workers=2, max_instances_in_memory=8, quiet=True)
        with loader:
            return sorted(sorted(b["index"].tolist()) for b in loader)

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_the_arena_grows_and_batches_stay_intact():
    with aioloader.DataLoader(S.Growing(), batch_size=2, num_workers=2, quiet=True) as loader:
        for _ in range(2):
            for k, batch in enumerate(loader):
                assert batch.shape[0] == 2
                assert bool((batch[0] == 2 * k).all()) and bool((batch[1] == 2 * k + 1).all())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _shm() -> set[str]:
    """This process tree's own /dev/shm entries (other programs' come and go: issue 19)."""
    return _own_shm() if os.path.isdir("/dev/shm") else set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_segment_or_fd_per_batch_through_2000_batches():
    with aioloader.DataLoader([0], batch_size=1, quiet=True) as warm:
        list(warm)  # uvloop opens a process-wide signal pipe once: not ours to count
    fds_before, shm_before = _fds(), _shm()
    loader = aioloader.DataLoader(S.Payload(4000, 4096), batch_size=2, num_workers=2,
                                  quiet=True)
    fds_during: set[int] = set()
    shm_during: set[frozenset[str]] = set()
    n = 0
    for n, batch in enumerate(loader, 1):
        assert batch.shape == (2, 4096)
        if n >= 50 and n % 50 == 0:  # after start-up: the arenas exist by then
            fds_during.add(_fds())
            shm_during.add(frozenset(_shm()))
    assert n == 2000
    assert len(fds_during) == 1, f"open fds changed during the epoch: {sorted(fds_during)}"
    assert len(shm_during) == 1, "/dev/shm changed during the epoch"
    loader.close()
    assert _fds() == fds_before
    assert _shm() == shm_before


async def test_event_loop_lag_stays_small_while_waiting_for_slow_workers():
    loader = aioloader.DataLoader(S.SyncReader(24, sleep=0.05), batch_size=2, num_workers=2,
                                  max_instances_in_memory=4, quiet=True)
    lags: list[float] = []
    stop = asyncio.Event()
    streaming = asyncio.Event()  # measured once the workers run: forking them is start-up

    async def ticker() -> None:
        await streaming.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async def consume() -> list:
        out = []
        async for batch in loader:
            streaming.set()
            out.append(batch)
        return out

    task = asyncio.create_task(ticker())
    try:
        batches = await asyncio.wait_for(consume(), 120)
    finally:
        stop.set()
        await task
        await loader.aclose()
    assert sorted(indices(batches)) == list(range(24))
    assert len(lags) > 100
    # Behaviour, not speed (that is `aioloader bench --lag`): a loop that waited for a worker
    # would lose one reader sleep (50 ms) at a time, most ticks. On a machine whose cores
    # other processes fill, the scheduler alone makes a few ticks late, so the bound on the
    # tail stays under that sleep and the median carries the check (issue 19: p99 < 5 ms
    # failed under a CPU hog).
    median = statistics.median(lags)
    p99 = statistics.quantiles(lags, n=100)[98]
    assert median < 0.005, f"median lag of a 1 ms ticker: {median * 1000:.2f} ms"
    assert p99 < 0.040, f"p99 lag of a 1 ms ticker: {p99 * 1000:.2f} ms"


async def test_other_tasks_run_while_batches_come_without_a_wait():
    # num_workers=0 on the caller's loop: each batch is ready at once, so only the epoch's
    # own yields let another task in.
    data = torch.utils.data.TensorDataset(torch.arange(100_000))
    stop = asyncio.Event()
    turns: list[float] = []

    async def other_task() -> None:
        while not stop.is_set():
            turns.append(time.perf_counter())
            await asyncio.sleep(0)

    async with aioloader.DataLoader(data, batch_size=4, quiet=True) as loader:
        gc.collect()  # the first full collection after torch's import took 100-120 ms
        task = asyncio.create_task(other_task())
        try:
            turns.append(time.perf_counter())
            batches = sum([1 async for _ in loader])
            turns.append(time.perf_counter())
        finally:
            stop.set()
            await task
    assert batches == 25_000
    took = turns[-1] - turns[0]
    gaps = [b - a for a, b in itertools.pairwise(turns)]
    # Without the yields the task waited for the whole epoch but its first few batches. The
    # bound is relative (a quarter of the epoch), not a number of milliseconds: a loaded
    # 2-core box deschedules the whole process for 100 ms and more now and then.
    assert len(turns) > batches / 100, f"the other task ran {len(turns)} times"
    assert max(gaps) < took / 4, f"longest wait {max(gaps) * 1000:.0f} ms of {took:.2f} s"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_value_the_collate_cannot_handle_is_named(num_workers):
    loader = aioloader.DataLoader(S.Uncollatable(), batch_size=2, num_workers=num_workers,
                                  quiet=True)
    expected = aioloader.WorkerError if num_workers else TypeError
    with pytest.raises(expected) as info:
        list(loader)
    text = str(info.value)
    assert "object" in text and "thing" in text, text
    loader.close()


def test_public_names_match_the_contract():
    contract = {"DataLoader", "Reader", "WorkerInfo", "get_worker_info", "WorkerError",
                "PadCollate", "BatchSampler", "BucketBatchSampler"}
    assert contract <= set(aioloader.__all__)
    for name in aioloader.__all__:
        assert getattr(aioloader, name).__module__.startswith("aioloader")


def _draws(seed: int, epochs: int = 2, set_epoch: int | None = None) -> list[list[tuple]]:
    loader = aioloader.DataLoader(S.Draws(), batch_size=2, num_workers=2, seed=seed,
                                  max_instances_in_memory=4, quiet=True)
    with loader:
        if set_epoch is not None:
            loader.set_epoch(set_epoch)
        out = []
        for _ in range(epochs):
            rows = [tuple(b[k][j].item() for k in ("wid", "seed", "py", "np", "torch"))
                    for b in loader for j in range(len(b["index"]))]
            out.append(sorted(rows))
        return out


def test_worker_seeds_come_from_seed_epoch_and_worker():
    a, b, other = _draws(7), _draws(7), _draws(8)
    assert a == b, "same seed: the same random draws in every worker, epoch by epoch"
    assert a != other, "another seed: other draws"
    first, second = a
    assert first != second, "each epoch reseeds the workers differently"
    seeds = {row[1] for row in first}
    assert len(seeds) == 2, "each worker has its own seed"
    draws_by_worker = {row[0]: row[2] for row in first if row[2]}
    assert len(set(draws_by_worker.values())) == 2, "workers draw independent numbers"


def test_set_epoch_replays_that_epoch():
    full = _draws(3, epochs=2)
    assert _draws(3, epochs=1, set_epoch=1) == [full[1]]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_leased_batches_stay_intact_when_hoarded(num_workers):
    """Large batches are views of a slot until dropped; a hoarding consumer must neither
    stall the workers nor see a kept batch change (the loader falls back to copying)."""
    n, numel = 40, 300_000  # 2 x 1.2 MB a batch: above the lease threshold
    loader = aioloader.DataLoader(S.Payload(n, numel), batch_size=2, num_workers=num_workers,
                                  quiet=True)
    kept = list(loader)
    assert len(kept) == n // 2
    more = list(loader)  # the slots go round again while the first epoch is still held
    loader.close()
    for k, batch in enumerate(kept + more):
        i = 2 * (k % (n // 2))
        assert bool((batch[0] == i).all()) and bool((batch[1] == i + 1).all()), k
    kept[0].fill_(-1)  # writable, and its own
    assert bool((kept[1][0] == 2).all())


def test_cached_instances_with_large_tensors_reach_workers_forked_later():
    """The cache is read through one set of workers and served by the next (forked after):
    its tensors must be the parent's own memory, not views of the first workers' arenas."""
    reader = S.BigInstances(120, 40_000)
    with aioloader.DataLoader(reader, batch_size=8, num_workers=2, quiet=True) as loader:
        for _ in range(2):
            batches = list(loader)
            assert sorted(indices(batches)) == list(range(120))
            for b in batches:
                assert torch.equal(b["x"][:, 0], b["index"].float())
