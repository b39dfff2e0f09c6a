"""Self-healing workers (issue 12): a SIGKILLed worker is replaced, its undelivered work is
redone exactly once, in order; past max_worker_restarts the last death is raised.

Each case runs tests/heal_victim.py in a subprocess with a hard deadline: it kills its own
workers from the consumer's loop, after a given batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

VICTIM = Path(__file__).parent / "heal_victim.py"
HANG_VICTIM = Path(__file__).parent / "hang_victim.py"


def victim(kind: str, start_method: str, restarts: int, *kills: int) -> tuple[Any, str]:
    proc = subprocess.run(
        [sys.executable, str(VICTIM), kind, start_method, str(restarts), *map(str, kills)],
        capture_output=True, text=True, timeout=180, start_new_session=True)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.deadline(200)
@pytest.mark.parametrize(("kind", "start_method", "kill_after"), [
    ("map", "fork", 5),
    ("lazy", "fork", 5),
    ("cached", "fork", 7),
    ("map", "spawn", 4),
    ("lazy", "spawn", 3),
    ("map", "fork", 0),  # during the first batch
    ("lazy", "fork", 0),
    ("cached", "fork", 0),
    ("loads", "fork", 5),  # a load stage (issue 11): keys from the position, loads again
    ("loads-map", "fork", 3),
])
def test_a_killed_worker_is_replaced_and_nothing_is_lost_or_repeated(
        kind: str, start_method: str, kill_after: int) -> None:
    result, stderr = victim(kind, start_method, 1, kill_after)
    assert result["error"] is None, result["error"]
    assert result["seen"] == result["reference"]  # every batch once, in order
    assert result["pids"] >= 3 or kill_after == 0  # the replacement built batches too
    assert "restarting it (restart 1 of max_worker_restarts=1)" in stderr
    assert stderr.count("restarting it") == 1


@pytest.mark.deadline(200)
def test_ordered_false_heals_with_every_key_once() -> None:
    """Loads finish out of order: the replacement goes on from the keys delivered (issue 21),
    so every key arrives once; the order is the loads' own."""
    result, stderr = victim("loads-unordered", "fork", 1, 5)
    assert result["error"] is None, result["error"]
    seen = sorted(i for batch in result["seen"] for i in batch)
    assert seen == sorted(i for batch in result["reference"] for i in batch)
    assert len(seen) == len(set(seen))
    assert result["pids"] >= 3  # the replacement built batches too
    assert stderr.count("restarting it") == 1


@pytest.mark.deadline(200)
@pytest.mark.parametrize("kind", ["lazy", "loads-unordered", "map"])
def test_a_worker_killed_after_a_resume_on_another_shape_heals(kind: str) -> None:
    """3 workers took 4 batches; 2 workers go on from that state, and one is killed."""
    result, stderr = victim(f"{kind}-reshaped", "fork", 1, 3)
    assert result["error"] is None, result["error"]
    seen = sorted(i for batch in result["seen"] for i in batch)
    assert seen == sorted(i for batch in result["reference"] for i in batch)
    if kind == "map":  # index batches do not depend on workers: the same batches
        assert result["seen"] == result["reference"]
    assert stderr.count("restarting it") == 1


@pytest.mark.deadline(200)
@pytest.mark.parametrize("kind", ["map", "lazy"])
def test_two_deaths_heal_with_a_budget_of_two(kind: str) -> None:
    result, stderr = victim(kind, "fork", 2, 3, 9)
    assert result["error"] is None, result["error"]
    assert result["seen"] == result["reference"]
    assert stderr.count("restarting it") == 2


@pytest.mark.deadline(200)
def test_a_death_past_the_budget_raises_worker_died_naming_every_death() -> None:
    result, _ = victim("map", "fork", 1, 3, 9)
    error = result["error"]
    assert error is not None and error["type"] == "WorkerDied"
    assert len(error["deaths"]) == 2
    assert "max_worker_restarts=1 were spent on earlier deaths: worker" in error["message"]
    assert "killed by signal 9" in error["message"]
    assert result["seen"] == result["reference"][:len(result["seen"])]  # nothing skipped


@pytest.mark.deadline(200)
def test_without_restarts_a_death_still_fails_fast() -> None:
    result, stderr = victim("lazy", "fork", 0, 4)
    assert result["error"] is not None and result["error"]["type"] == "WorkerDied"
    assert len(result["error"]["deaths"]) == 1
    assert "restarting" not in stderr


def test_max_worker_restarts_is_validated() -> None:
    import aioloader

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_worker_restarts must be an int >= 0"):
            aioloader.DataLoader([1, 2], batch_size=1, max_worker_restarts=bad)


def hang_victim(how: str, start_method: str, restarts: int,
                tmp_path: Path) -> tuple[Any, str]:
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [sys.executable, str(HANG_VICTIM), how, start_method, str(restarts), str(fifo)],
        capture_output=True, text=True, timeout=150, start_new_session=True,
        cwd=Path(__file__).parent)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.deadline(170)
@pytest.mark.parametrize(("how", "start_method"), [
    ("sigstop", "fork"),  # SIGKILL ends a stopped process too
    ("sigstop", "spawn"),
    ("getitem", "fork"),  # a read that never returns, in __getitem__
    ("init", "fork"),  # ... in worker_init_fn, before the worker's first word
])
def test_a_hung_worker_is_killed_and_replaced_and_nothing_is_lost_or_repeated(
        how: str, start_method: str, tmp_path: Path) -> None:
    """Issue 33: silent for ``timeout`` while the consumer waits for its batch, the worker is
    killed and replaced like a dead one; the epoch is exact and in order; stats and the
    log say it was a hang."""
    result, stderr = hang_victim(how, start_method, 1, tmp_path)
    assert result["error"] is None, result["error"]
    assert result["seen"] == result["reference"]  # every batch once, in order
    assert (result["restarts"], result["hangs"], result["crashes"]) == (1, 1, 0)
    assert result["left"] == []
    assert "hung: no word for" in stderr and "killing it (SIGKILL)" in stderr
    assert "(a hang); restarting it (restart 1 of max_worker_restarts=1)" in stderr


@pytest.mark.deadline(120)
def test_a_starved_worker_is_slow_not_hung(tmp_path: Path) -> None:
    """A worker that is runnable but gets no CPU for longer than ``timeout`` (a loaded
    machine; here SCHED_IDLE on a CPU a busy process holds) shows progress: the time it
    waited for a CPU is not silence, so it is not killed as hung and its batch arrives."""
    result, stderr = hang_victim("starved", "fork", 1, tmp_path)
    assert result["error"] is None, result["error"]
    assert result["seen"] == result["reference"]
    assert (result["restarts"], result["hangs"], result["crashes"]) == (0, 0, 0), stderr
    assert result["left"] == []


@pytest.mark.deadline(120)
@pytest.mark.parametrize("how", ["sigstop", "getitem"])
def test_without_restarts_a_hung_worker_times_out(how: str, tmp_path: Path) -> None:
    result, _ = hang_victim(how, "fork", 0, tmp_path)
    assert result["error"]["type"] == "LoaderTimeoutError", result["error"]
    assert "still waiting for worker" in result["error"]["message"]
    assert "with max_worker_restarts=1 or more, a worker that hangs is killed and replaced" \
        in result["error"]["message"]
    assert result["left"] == []


async def test_a_hung_thread_worker_times_out_and_says_threads_cannot_be_killed() -> None:
    """Thread workers cannot be killed: a hung one is reported, never replaced."""
    import threading

    import aioloader

    gate = threading.Event()

    class Stalls:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            if i == 5:
                gate.wait(30)
            return i

    loader = aioloader.DataLoader(Stalls(), batch_size=2, num_workers=2, worker_type="thread",
                                  timeout=0.5, quiet=True)
    try:
        with pytest.raises(aioloader.LoaderTimeoutError, match="thread workers cannot be killed"):
            async for _ in loader:
                pass
    finally:
        gate.set()
        await loader.aclose()
    with pytest.raises(ValueError, match="cannot be killed"):
        aioloader.DataLoader(Stalls(), batch_size=2, num_workers=2, worker_type="thread",
                             max_worker_restarts=1)
