"""``num_workers=0`` through ``async for``: fetches run in the loader's thread, ahead of the
consumer, and never on the caller's loop unless ``fetch_on_loop=True`` asks (issue 33); the
caller's torch threads stay as they were: the loop's thread and a thread started later. The
training step's speed beside an epoch is a benchmark's (``aioloader bench --step-ms``), not a
timed test's: on a busy 2-core machine a matmul's time moves 20x with the neighbours' load."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
from typing import Any

import pytest
import torch

import aioloader


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


async def test_fetches_run_in_the_thread_ahead_of_the_consumer() -> None:
    """Every fetch runs in the fetch thread on one OpenMP thread of its own (never on the
    caller's thread, issue 33), and the thread runs ahead: while the consumer holds one
    batch, the next ones are already being built. No thread's count changes."""
    mine, fresh = torch.get_num_threads(), _fresh_thread_count()
    where: list[tuple[bool, int]] = []
    async with aioloader.DataLoader(Small(), batch_size=4, quiet=True, prefetch=3) as loader:
        async for batch in loader:
            where.append((bool(batch["main"].any()), int(batch["threads"][0])))
            assert torch.get_num_threads() == mine  # between batches, here
    assert set(where) == {(False, 1)} and len(where) == 400
    assert torch.get_num_threads() == mine
    assert _fresh_thread_count() == fresh  # torch's process-wide count too


class Gated:
    """Samples that record when they were made; sample ``gate_at`` waits for ``gate``."""

    def __init__(self, gate: threading.Event, gate_at: int) -> None:
        self.gate, self.gate_at = gate, gate_at
        self.made: list[int] = []
        self.started = threading.Event()

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == self.gate_at:
            self.started.set()
            self.gate.wait(30)
        self.made.append(i)
        return i


@pytest.mark.deadline(60)
async def test_the_thread_runs_prefetch_batches_ahead_and_no_further() -> None:
    """With ``prefetch=2``, while the consumer holds batch 0 the thread builds batches 1
    and 2 and starts no third: the gate in batch 2 holds it, and batch 3's sample is
    never fetched before the consumer asks."""
    gate = threading.Event()
    data = Gated(gate, gate_at=2)
    async with aioloader.DataLoader(data, batch_size=1, quiet=True, prefetch=2) as loader:
        it = aiter(loader)
        first = await anext(it)
        await asyncio.to_thread(data.started.wait, 30)  # batch 2 is being fetched
        assert int(first) == 0 and data.made == [0, 1]
        gate.set()
        rest = [int(b) async for b in it]
    assert rest == list(range(1, 12)) and data.made == list(range(12))


async def test_fetch_on_loop_runs_fetches_on_the_callers_thread() -> None:
    """``fetch_on_loop=True``: what the user asked for, as torch's num_workers=0 runs them,
    with the caller's torch thread count; other tasks still get a turn between batches."""
    mine = torch.get_num_threads()
    turns = 0
    ready = asyncio.Event()

    async def other() -> None:
        nonlocal turns
        while True:
            await ready.wait()
            ready.clear()
            turns += 1

    task = asyncio.create_task(other())
    seen: list[tuple[int, bool, int]] = []
    try:
        async with aioloader.DataLoader(Small(), batch_size=4, quiet=True,
                                        fetch_on_loop=True) as loader:
            async for batch in loader:
                seen.append((turns, bool(batch["main"].all()), int(batch["threads"][0])))
                ready.set()
    finally:
        task.cancel()
    assert {(main, threads) for _, main, threads in seen} == {(True, mine)}
    assert all(after > before for (before, *_), (after, *_) in itertools.pairwise(seen))


def test_fetch_on_loop_needs_num_workers_0() -> None:
    with pytest.raises(ValueError, match=r"fetch_on_loop=True .* num_workers=2"):
        aioloader.DataLoader(Small(), batch_size=4, num_workers=2, fetch_on_loop=True)


class WaitsForTheLoop:
    """400 samples; every 16th waits for the caller's loop (an async client bound to that
    loop, asked on a cache miss). Each records the thread it ran on."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, every: int = 16) -> None:
        self.loop = loop
        self.every = every
        self.threads: list[int] = []

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> int:
        self.threads.append(threading.get_ident())
        if self.loop is not None and i % self.every == self.every - 1:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()
        return i


@pytest.mark.deadline(60)
@pytest.mark.parametrize("timeout", [None, 60])
async def test_a_dataset_that_waits_for_the_loop_never_hangs_it(timeout: int | None) -> None:
    """Issue 33: with fetches proven short moved onto the loop, the first miss there hung
    it (60 s deadline). By default no __getitem__ runs on the loop's thread."""
    data = WaitsForTheLoop(asyncio.get_running_loop())
    async with aioloader.DataLoader(data, batch_size=4, quiet=True,
                                    timeout=timeout) as loader:
        got = [i for b in [b async for b in loader] for i in b.tolist()]
    assert got == list(range(400))
    assert len(data.threads) == 400 and threading.get_ident() not in data.threads


async def test_no_fetch_runs_on_the_loops_thread_for_any_source_kind() -> None:
    """Index batches with a load stage too: the collate runs in the thread."""
    data = WaitsForTheLoop(None)

    def collate(items: list[int]) -> list[int]:
        data.threads.append(threading.get_ident())
        return items

    async with aioloader.DataLoader(list(range(40)), batch_size=4, quiet=True,
                                    load_fn=data.__getitem__, collate_fn=collate) as loader:
        got = [i async for b in loader for i in b]
    assert got == list(range(40)) and threading.get_ident() not in data.threads


def test_the_sync_face_fetches_here_with_the_callers_count() -> None:
    """Inline, as torch's num_workers=0 does: nothing to change there."""
    mine = torch.get_num_threads()
    with aioloader.DataLoader(Augmented(8), batch_size=4, quiet=True) as loader:
        threads = {n for batch in loader for n in batch["threads"].tolist()}
    assert threads == {mine}
    assert torch.get_num_threads() == mine


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
    """The fetch thread shares large stacks with the helper; the helper runs under
    SCHED_IDLE, beside the caller's loop. Only this loader's helper counts: another
    test's, not yet ended, once hid a helper that never ran (a context variable that the
    fetch thread's calls did not see)."""
    def helpers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("aioloader-copy")}

    before = helpers()
    async with aioloader.DataLoader(_Images(), batch_size=32, quiet=True) as loader:
        firsts = [batch[:, 0, 0, 0].tolist() async for batch in loader]
        ids = [t.native_id for t in helpers() - before]
        assert ids and None not in ids, f"no copy helper ran for this loader: {ids}"
        assert {os.sched_getscheduler(i) for i in ids if i is not None} == {os.SCHED_IDLE}
    assert firsts == [list(range(32)), list(range(32, 64))]


def test_a_pass_planned_early_on_one_loop_is_planned_again_on_another() -> None:
    """Plans (in the thread) plan the next pass while this one is consumed, on this
    epoch's loop; an epoch on another loop (the other face, a new ``asyncio.run``) plans
    its own. Each epoch gives all the data."""
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
