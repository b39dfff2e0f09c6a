"""``num_workers=0`` through ``async for`` (issue 23): fetches proven short run on the caller's
thread, others in the fetch thread; the caller's torch threads stay as they were: the loop's
thread, a thread started later, and the training step's speed."""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import threading
import time
from typing import Any

import pytest
import torch

import aioloader
from aioloader._placement import PROOF


class Augmented:
    """150 KB uint8 images with one elementwise op each, as an augmentation does; each sample
    says which thread made it and with how many torch threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.bank = torch.randint(0, 200, (4, 3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.bank[i % 4] + 1, "threads": torch.get_num_threads(),
                "main": threading.current_thread() is threading.main_thread()}


def _fresh_thread_count() -> int:
    """What a thread that has run no torch op yet gets: torch's process-wide count."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


class Small:
    """Cheap samples (a few microseconds of torch each) that say where they were made."""

    def __len__(self) -> int:
        return 4 * 400

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.zeros(8) + i, "threads": torch.get_num_threads(),
                "main": threading.current_thread() is threading.main_thread()}


async def test_short_fetches_move_to_the_callers_thread_once_proven() -> None:
    """The first fetches run in the fetch thread on one OpenMP thread of its own; once they
    have shown they are short and busy, on the caller's thread with the caller's count, as
    torch's num_workers=0 runs them (issue 23). No thread's count changes."""
    mine, fresh = torch.get_num_threads(), _fresh_thread_count()
    where: list[tuple[bool, int]] = []
    async with aioloader.DataLoader(Small(), batch_size=4, quiet=True) as loader:
        async for batch in loader:
            assert len(set(batch["main"].tolist())) == 1  # a batch is fetched in one place
            where.append((bool(batch["main"][0]), int(batch["threads"][0])))
            assert torch.get_num_threads() == mine  # between batches, here
    assert where[:PROOF] == [(False, 1)] * PROOF
    on_loop = {threads for main, threads in where if main}
    in_thread = {threads for main, threads in where if not main}
    # A busy machine may send fetches back to the thread, never all 400 batches.
    assert on_loop == {mine} and in_thread == {1}, where
    assert torch.get_num_threads() == mine
    assert _fresh_thread_count() == fresh  # torch's process-wide count too


async def test_other_tasks_run_between_batches_fetched_on_the_loop() -> None:
    """A task made ready after each batch runs before the next batch is handed over."""
    turns = 0
    ready = asyncio.Event()

    async def other() -> None:
        nonlocal turns
        while True:
            await ready.wait()
            ready.clear()
            turns += 1

    task = asyncio.create_task(other())
    seen: list[tuple[int, bool]] = []
    try:
        async with aioloader.DataLoader(Small(), batch_size=4, quiet=True) as loader:
            async for batch in loader:
                seen.append((turns, bool(batch["main"][0])))
                ready.set()
    finally:
        task.cancel()
    assert any(main for _, main in seen)
    pairs = itertools.pairwise(seen)
    assert all(after > before for (before, _), (after, main) in pairs if main)


class Waits:
    """Samples that block (a sleep) or wait for the caller's loop, which must stay free: each
    says where it was made."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, work: float = 0.0) -> None:
        self.loop = loop
        self.work = work  # seconds of computation a sample before its wait

    def __len__(self) -> int:
        return 4 * (PROOF * 3)

    def __getitem__(self, i: int) -> bool:
        end = time.thread_time() + self.work
        while time.thread_time() < end:
            pass
        if self.loop is None:
            time.sleep(0.0005)
        else:  # run on the loop it is consumed on: that loop must not be this thread
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()
        return threading.current_thread() is threading.main_thread()


@pytest.mark.deadline(60)
@pytest.mark.parametrize("how", ["sleeps", "awaits the loop", "works, then awaits the loop"])
async def test_a_fetch_that_waits_never_runs_on_the_loop(how: str) -> None:
    """However busy it is besides: one that waits for the loop would hang it there. A batch
    of 4 samples of 0.4 ms of computation and one round trip each is 95 % busy."""
    loop = asyncio.get_running_loop() if "loop" in how else None
    work = 0.0004 if how.startswith("works") else 0.0
    async with aioloader.DataLoader(Waits(loop, work), batch_size=4, quiet=True) as loader:
        made_on_main = [bool(b.any()) async for b in loader]
    assert made_on_main == [False] * (PROOF * 3)


class WaitsOnAMiss:
    """Samples that wait for the caller's loop only now and then (the last of each 16, a
    cache miss): the fetches before prove short and busy."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> bool:
        if i % 16 == 15:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()
        return threading.current_thread() is threading.main_thread()


@pytest.mark.deadline(60)
async def test_a_timeout_keeps_a_fetch_that_waits_now_and_then_off_the_loop() -> None:
    """What docs/performance.md tells such a dataset's user: without ``timeout=`` its quiet
    fetches would move onto the loop, and the first miss there would hang it."""
    data = WaitsOnAMiss(asyncio.get_running_loop())
    async with aioloader.DataLoader(data, batch_size=4, timeout=60, quiet=True) as loader:
        made_on_main = [bool(b.any()) async for b in loader]
    assert made_on_main == [False] * 16


def test_the_sync_face_fetches_here_with_the_callers_count() -> None:
    """Inline, as torch's num_workers=0 does: nothing to change there."""
    mine = torch.get_num_threads()
    with aioloader.DataLoader(Augmented(8), batch_size=4, quiet=True) as loader:
        threads = {n for batch in loader for n in batch["threads"].tolist()}
    assert threads == {mine}
    assert torch.get_num_threads() == mine


def _matmul_ms(a: torch.Tensor, repeats: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, a)
    return (time.perf_counter() - start) / repeats * 1e3


async def test_the_training_step_is_not_slowed_by_the_epoch() -> None:
    """A matmul on the caller's thread, between batches, takes about what it takes without a
    loader. The bound is generous (a busy machine moves both figures): it catches a caller
    left on one thread or a loader thread spinning beside the step, not a few per cent.
    Quiet spells and epochs alternate, so that the machine's load falls on both sides."""
    a = torch.randn(384, 384)
    _matmul_ms(a, repeats=5)  # warm: MKL, the OpenMP team, the allocator
    before: list[float] = []
    during: list[float] = []
    loader = aioloader.DataLoader(Augmented(10 * 8), batch_size=8, quiet=True)
    try:
        for _ in range(4):
            before += [_matmul_ms(a) for _ in range(10)]
            async for _ in loader:
                during.append(_matmul_ms(a))
    finally:
        await loader.aclose()
    ratio = statistics.median(during) / statistics.median(before)
    assert ratio < 3.0, f"a matmul took {ratio:.2f}x its time without the loader"


LOAD_STAGE_LEAK = """
import asyncio, threading, torch, aioloader

def fresh():
    out = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]

def load(k):
    return torch.zeros(3) + k

before = fresh()

async def main():
    async with aioloader.DataLoader(list(range(64)), batch_size=4, quiet=True,
                                    load_fn=load, concurrency=4) as loader:
        async for _ in loader:
            pass

asyncio.run(main())
print(before, fresh(), torch.get_num_threads())
"""


def test_a_load_stage_leaves_other_threads_their_torch_thread_count() -> None:
    # issue 23: the load threads' initializer was torch.set_num_threads(1), which also set
    # the count every thread yet to run a parallel op starts with: after one epoch with a
    # load_fn, a new thread (or a main thread early in a script) ran on one thread.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LOAD_STAGE_LEAK], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    before, after, main_thread = map(int, done.stdout.split())
    assert after == before and main_thread == before, done.stdout


class _Images:
    """Samples of 150 KB: a batch of 32 is past the copy helper's 4 MB."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), i, dtype=torch.uint8)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own scheduling policy: Linux")
async def test_the_copy_helper_takes_only_idle_cores_and_the_batches_are_whole() -> None:
    """``timeout=`` keeps every fetch in the fetch thread, which shares large stacks with
    the helper; the helper runs under SCHED_IDLE, beside the caller's loop."""
    async with aioloader.DataLoader(_Images(), batch_size=32, timeout=60,
                                    quiet=True) as loader:
        firsts = [batch[:, 0, 0, 0].tolist() async for batch in loader]
        helpers = [t for t in threading.enumerate() if t.name.startswith("aioloader-copy")]
        ids = [t.native_id for t in helpers]
        assert ids and None not in ids, f"no copy helper running: {ids}"
        assert {os.sched_getscheduler(i) for i in ids if i is not None} == {os.SCHED_IDLE}
    assert firsts == [list(range(32)), list(range(32, 64))]


def test_a_pass_planned_early_on_one_loop_is_planned_again_on_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans kept in the thread (a bound of 0: none proves short) plan the next pass while
    this one is consumed, on this epoch's loop; an epoch on another loop (the other face, a
    new ``asyncio.run``) plans its own. Each epoch gives all the data."""
    monkeypatch.setattr(aioloader._producers, "LIMIT", 0.0)
    data = list(range(10))

    async def consume(loader: aioloader.DataLoader) -> list[int]:
        return [i for batch in [b async for b in loader] for i in batch.tolist()]

    loader = aioloader.DataLoader(data, batch_size=4, quiet=True)
    try:
        for _ in range(2):
            assert [i for b in loader for i in b.tolist()] == data
            assert asyncio.run(consume(loader)) == data
            assert asyncio.run(consume(loader)) == data
    finally:
        loader.close()
