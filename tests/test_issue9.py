"""Issue 9: one regression test per row of its table, written as a user writes the code.

No test closes a loader where the user in that row would not: a dropped loader is the
garbage collector's business, and the autouse leak check (tests/conftest.py) then finds no
process, fd or /dev/shm entry left. Performance rows are tested through their structural
cause (a Runner per batch, a shuffle on the event loop), not timed.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

import aioloader
from aioloader.testing import LeakError, LeakSnapshot, check_leaks

sys.path.insert(0, str(Path(__file__).parent / "scripts_issue9"))
import issue9_dist
import issue9_sources as S

HERE = Path(__file__).parent
PROMPT = 10.0  # seconds: "promptly", with room for a loaded 2-core machine


def indices(batches: list[Any]) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


# --------------------------------------------------------------- row: a loader per evaluate()

def evaluate(dataset: Any) -> int:
    loader = aioloader.DataLoader(dataset, batch_size=32, num_workers=2, quiet=True)
    return sum(int(batch.sum()) for batch in loader)


@pytest.mark.deadline(180)
def test_a_loader_built_per_evaluate_call_and_never_closed():
    dataset = S.Ints(200)
    outcomes: list[Any] = []
    for _ in range(10):
        try:
            outcomes.append(evaluate(dataset))
        except Exception as exc:  # noqa: BLE001 - each call's outcome is what we compare
            outcomes.append(repr(exc))
    assert outcomes == [sum(range(200))] * 10


@pytest.mark.deadline(180)
def test_train_and_val_interleaved_with_a_loader_dropped_along_the_way():
    train = aioloader.DataLoader(S.Records(96), batch_size=8, shuffle=True, num_workers=2,
                                 quiet=True)
    outcomes: list[Any] = []
    for epoch in range(4):
        # a fresh val loader each epoch: the previous one is dropped, never closed
        val = aioloader.DataLoader(S.Records(40), batch_size=8, num_workers=2, quiet=True)
        try:
            train_seen = sorted(indices(list(train)))
            val_seen = indices(list(val))
            outcomes.append((train_seen == list(range(96)), val_seen == list(range(40))))
        except Exception as exc:  # noqa: BLE001 - each epoch's outcome is what we compare
            outcomes.append(f"epoch {epoch}: {exc!r}")
    assert outcomes == [(True, True)] * 4


# --------------------------------------------------------- rows: a close from elsewhere

@pytest.fixture
def gate() -> Iterator[S.Gate]:
    g = S.Gate()
    yield g
    g.close()


@pytest.mark.deadline(90)
@pytest.mark.parametrize("num_workers", [0, 2])
async def test_aclose_from_another_task_ends_the_waiting_consumer(num_workers, gate):
    loader = aioloader.DataLoader(S.Gated(16, gate), batch_size=1, num_workers=num_workers,
                                  quiet=True)
    first = asyncio.Event()

    async def consume() -> list[Any]:
        out = []
        async for batch in loader:
            out.append(batch)
            first.set()
        return out

    consumer = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(first.wait(), 60)
        for _ in range(5):  # let the consumer get back to awaiting batch 1 (gated)
            await asyncio.sleep(0)
        await asyncio.wait_for(loader.aclose(), PROMPT)  # service shutdown
        done, _ = await asyncio.wait({consumer}, timeout=PROMPT)
        assert done, f"the consumer still waits {PROMPT:.0f}s after aclose() from another task"
        with pytest.raises(aioloader.LoaderClosedError):
            consumer.result()
    finally:
        gate.set()
        if not consumer.done():
            consumer.cancel()
            await asyncio.wait({consumer}, timeout=PROMPT)
    # the loader can be iterated again afterwards
    assert indices([b async for b in loader]) == list(range(16))
    await loader.aclose()


@pytest.mark.deadline(90)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("inside_a_loop", [False, True], ids=["script", "jupyter"])
def test_close_from_a_watchdog_thread_ends_the_sync_consumer(num_workers, inside_a_loop, gate):
    # "jupyter": the sync face used from a thread that already runs an event loop, so the
    # adapter's loop runs in a thread of its own.
    # Without workers the sync face may fetch in the consumer's own thread, as torch does: a
    # close can land only between two samples there, so they come slowly instead of never.
    dataset = S.Gated(16, gate) if num_workers else S.Slow(16, 0.2)
    loader = aioloader.DataLoader(dataset, batch_size=1, num_workers=num_workers, quiet=True)
    first, ended = threading.Event(), threading.Event()
    problems: list[str] = []

    def watchdog() -> None:
        if not first.wait(60):
            problems.append("no first batch within 60s")
            return
        try:
            loader.close()
        except BaseException as exc:  # noqa: BLE001 - reported with the consumer's outcome
            problems.append(f"close() from the watchdog thread raised {exc!r}")
        if not ended.wait(PROMPT):
            problems.append(f"the consumer still waits {PROMPT:.0f}s after close()")
            gate.set()  # let it finish, so that the test ends

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    def consume() -> Any:
        try:
            for _ in loader:
                first.set()
            return "the epoch ended normally"
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - checked below
            return exc

    async def consume_in_a_loop() -> Any:
        return consume()

    outcome: Any = None
    try:
        outcome = asyncio.run(consume_in_a_loop()) if inside_a_loop else consume()
    finally:
        ended.set()
        gate.set()
        thread.join(2 * PROMPT)
    assert not problems, problems
    assert type(outcome).__name__ == "LoaderClosedError", repr(outcome)
    assert isinstance(outcome, aioloader.LoaderClosedError)
    assert indices(list(loader)) == list(range(16)), "iterated again after close()"
    loader.close()


# ------------------------------------------------------------------------ rows: distributed

# three_loaders last: it is the case that drops loaders for the garbage collector
DIST_CASES = ["batch_sampler", "iterable_lazy", "iterable_cached", "three_loaders"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return issue9_dist.run_ranks(tmp_path_factory.mktemp("ranks"), DIST_CASES, deadline=150)


def _case(two_ranks: dict[int, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    per_rank = [two_ranks[r][name] for r in range(2)]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}: {res['error']}"
    return per_rank


@pytest.mark.deadline(240)
def test_batch_sampler_over_distributed_sampler_is_not_resharded(two_ranks):
    ranks = _case(two_ranks, "batch_sampler")
    for r, res in enumerate(ranks):
        assert res["indices"] == res["expected"], f"rank {r} got other instances than its sampler"
    seen = ranks[0]["indices"] + ranks[1]["indices"]
    assert sorted(seen) == list(range(issue9_dist.N)), (
        f"{len(set(seen))} distinct of {issue9_dist.N}")


@pytest.mark.deadline(240)
@pytest.mark.parametrize("case", ["iterable_lazy", "iterable_cached"])
def test_an_iterable_dataset_that_splits_itself_by_node_is_not_split_again(two_ranks, case):
    ranks = _case(two_ranks, case)
    seen = ranks[0]["indices"] + ranks[1]["indices"]
    assert sorted(seen) == list(range(issue9_dist.N)), (
        f"{len(set(seen))} distinct of {issue9_dist.N}, {len(seen)} in all")


@pytest.mark.deadline(240)
def test_a_distributed_script_that_builds_three_loaders_in_a_row(two_ranks):
    ranks = _case(two_ranks, "three_loaders")
    for k in range(3):
        seen = ranks[0]["loaders"][k] + ranks[1]["loaders"][k]
        assert sorted(seen) == list(range(48)), f"loader {k}"


# --------------------------------------------------------------------- row: surrogate strings

@pytest.mark.deadline(60)
def test_a_file_name_with_undecodable_bytes_survives_the_workers():
    dataset = S.Named(12)
    loader = aioloader.DataLoader(dataset, batch_size=4, num_workers=2, quiet=True)
    batches = list(loader)
    assert len(batches) == 3
    for k, batch in enumerate(batches):
        expected = default_collate([dataset[i] for i in range(4 * k, 4 * k + 4)])
        assert isinstance(batch, dict), f"batch {k} is a {type(batch).__name__}: {batch!r:.200}"
        assert batch["path"] == expected["path"]
        assert torch.equal(batch["x"], expected["x"])


# ---------------------------------------------------------------- row: a 2M-index shuffle

LAG_BOUND = 0.75  # s; planning on the loop: 3 s of CPU here (5.5-7.7 s under load)


@pytest.mark.deadline(120)
async def test_planning_a_shuffled_epoch_of_two_million_indices_is_off_the_loop():
    loader = aioloader.DataLoader(S.TwoMillion(), batch_size=32, shuffle=True, seed=1,
                                  quiet=True)
    gaps: list[float] = []
    stop = asyncio.Event()
    ticking = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            ticking.set()

    tick = asyncio.create_task(ticker())
    await ticking.wait()
    got = []
    try:
        async for batch in loader:
            got.append(batch)
            if len(got) == 3:
                break
    finally:
        stop.set()
        await tick
    assert [len(b) for b in got] == [32, 32, 32]
    assert max(gaps) < LAG_BOUND, f"the event loop stalled {max(gaps) * 1000:.0f} ms"


# ------------------------------------------------------------ row: timeout in cached mode

@pytest.mark.deadline(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_timeout_measures_silence_while_the_cache_is_read(num_workers):
    # 60 instances, one every 50 ms: 3 s of reading, never 1.5 s without an instance
    loader = aioloader.DataLoader(S.Trickle(60, 0.05), batch_size=4, num_workers=num_workers,
                                  timeout=1.5, quiet=True)
    assert sorted(indices(list(loader))) == list(range(60))


# ------------------------------------------------- rows: the sync face's per-batch Runner

@pytest.mark.deadline(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_sync_face_does_not_run_a_runner_per_batch(num_workers, monkeypatch):
    calls = 0
    real_run = asyncio.Runner.run

    def counting_run(self: asyncio.Runner, coro: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real_run(self, coro, **kwargs)

    monkeypatch.setattr(asyncio.Runner, "run", counting_run)

    def runs_for(batches: int) -> int:
        nonlocal calls
        loader = aioloader.DataLoader(S.Images(8 * batches), batch_size=8,
                                      num_workers=num_workers, quiet=True)
        calls = 0
        got = 0
        for batch in loader:
            assert batch["image"].shape == (8, 3, 32, 32)
            got += 1
        assert got == batches
        return calls

    short, long = runs_for(2), runs_for(20)
    assert long <= short and long <= 4, (
        f"asyncio.Runner.run ran {short} times for a sync epoch of 2 batches, {long} times "
        "for 20 batches")


# -------------------------------------------------------------- row: set_epoch every epoch

@pytest.mark.deadline(90)
def test_set_epoch_for_the_next_epoch_keeps_the_workers():
    loader = aioloader.DataLoader(S.Records(32), batch_size=4, shuffle=True, seed=3,
                                  num_workers=2, persistent_workers=True, quiet=True)
    pids: list[set[int]] = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert sorted(indices(batches)) == list(range(32))
        pids.append({p for b in batches for p in b["pid"].tolist()})
    assert len(pids[0]) == 2
    assert pids[0] == pids[1] == pids[2], f"worker pids per epoch: {pids}"


# ------------------------------------------- row: cancelling the consumer, again and again

REPS = 20


async def _cancel_once(loader: aioloader.DataLoader, point: str, rep: int) -> None:
    seen = asyncio.Event()
    count = 0
    stop_after = 1 if point == "first-batch" else 2 + rep % 5

    async def consume() -> None:
        nonlocal count
        async for _ in loader:
            count += 1
            if count == stop_after:
                seen.set()

    task = asyncio.create_task(consume())
    if point == "start":
        # sweep the start-up: right after the first __anext__ is scheduled, then later
        if rep < 5:
            for _ in range(rep):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep((rep - 4) * 0.005)  # the cancel point, not a synchronisation
    else:
        await asyncio.wait_for(seen.wait(), 60)
    t0 = time.monotonic()
    task.cancel()
    if point == "mid-epoch-twice":  # cancelled again while the first cancel is handled
        await asyncio.sleep(0)
        task.cancel()
    done, _ = await asyncio.wait({task}, timeout=PROMPT)
    took = time.monotonic() - t0
    assert done, f"rep {rep}: the cancelled consumer still runs {PROMPT:.0f}s later"
    assert took < PROMPT
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


@pytest.mark.deadline(240)
@pytest.mark.parametrize("point", ["start", "first-batch", "mid-epoch", "mid-epoch-twice"])
async def test_cancelling_the_consumer_again_and_again(point):
    loader = aioloader.DataLoader(S.Slow(400, 0.002), batch_size=2, num_workers=2,
                                  start_method="fork", quiet=True)
    for rep in range(REPS):
        baseline = LeakSnapshot.take()
        await _cancel_once(loader, point, rep)
        # that epoch's workers are gone, and so are its fds and segments
        try:
            await asyncio.to_thread(check_leaks, baseline, PROMPT)
        except LeakError as exc:
            raise AssertionError(f"{point}, rep {rep}: {exc}") from None
    # and the loader still serves a whole epoch
    assert sorted(indices([b async for b in loader])) == list(range(400))
    await loader.aclose()


# ------------------------------------------------------------------ row: the platform floor

def test_requires_python_and_mypy_agree():
    root = HERE.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    requires = config["project"]["requires-python"]
    mypy = config["tool"]["mypy"]["python_version"]
    assert requires.replace(" ", "") == f">={mypy}", (requires, mypy)
    assert sys.version_info >= tuple(int(x) for x in mypy.split("."))
