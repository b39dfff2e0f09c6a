"""A training script whose workers hang (issue 33); run by test_healing in a subprocess with a
hard deadline. Prints one JSON line: the ids it saw, its stats and how it ended.

    python hang_victim.py HOW START_METHOD RESTARTS FIFO

HOW: sigstop (after the consumer took batch 5 it SIGSTOPs the worker that built it) |
getitem (sample 30's __getitem__ opens FIFO for reading, which blocks until a writer
comes: none does) | init (worker 0's worker_init_fn does that) | starved (no hang: sample
30's worker is starved, not stopped: it moves itself onto the one CPU where a busy process
runs for HOG times the timeout, as SCHED_IDLE, and computes there; on a loaded machine a
slow worker is not a hung one). Each happens the first time only, across processes (an
exclusive create beside FIFO), so that a replacement goes on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from heal_victim import N, _workers, collate, item
from torch.utils.data import Dataset

import aioloader

TIMEOUT = {"fork": 2.0, "spawn": 20.0, "forkserver": 5.0}  # > a replacement's start here
STALL_AT = 30
HOG = 2.5  # the busy process's run, in timeouts
WORK = 0.05  # CPU seconds the starved worker needs for its sample


def busy(seconds: float, clock: Any = None) -> None:
    """Compute until ``clock`` (wall time by default) moved ``seconds``."""
    import time

    read = clock or time.monotonic
    end = read() + seconds
    while read() < end:
        pass


def one_cpu() -> int:
    return min(os.sched_getaffinity(0))


def first_time(fifo: str) -> bool:
    """True the first time across every process (an exclusive create)."""
    try:
        os.close(os.open(fifo + ".blocked", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def block_on(fifo: str) -> None:
    if first_time(fifo):
        with open(fifo, "rb"):  # no writer ever opens it: blocks for good
            pass


class Items(Dataset[dict[str, Any]]):
    def __init__(self, fifo: str | None, starve: str | None = None) -> None:
        self.fifo = fifo
        self.starve = starve

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.fifo is not None and i == STALL_AT:
            block_on(self.fifo)
        if self.starve is not None and i == STALL_AT and first_time(self.starve):
            import time

            os.sched_setaffinity(0, {one_cpu()})
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            busy(WORK, time.process_time)  # runnable all along, run only when the CPU idles
        return item(i)


class InitBlocks:
    def __init__(self, fifo: str) -> None:
        self.fifo = fifo

    def __call__(self, worker_id: int) -> None:
        if worker_id == 0:
            block_on(self.fifo)


def make(how: str, start_method: str, restarts: int, fifo: str | None) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        Items(fifo if how == "getitem" else None,
              fifo if how == "starved" and fifo is not None else None),
        batch_size=4, num_workers=2,
        start_method=start_method, max_worker_restarts=restarts, collate_fn=collate,
        timeout=None if fifo is None else TIMEOUT[start_method], quiet=True,
        worker_init_fn=InitBlocks(fifo) if how == "init" and fifo is not None else None)


def main() -> None:
    how, start_method, restarts, fifo = sys.argv[1:]
    with make(how, start_method, 0, None) as uninterrupted:
        reference = [b["i"].tolist() for b in uninterrupted]
    seen: list[list[int]] = []
    error = None
    loader = make(how, start_method, int(restarts), fifo)
    hog = None
    if how == "starved":  # busy on that one CPU, at the default priority, for a while
        import subprocess

        hog = subprocess.Popen([sys.executable, "-c", (
            f"import os, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"from hang_victim import busy, one_cpu; os.sched_setaffinity(0, {{one_cpu()}}); "
            f"busy({HOG * TIMEOUT[start_method]})")])
    try:
        for n, batch in enumerate(loader, 1):
            seen.append(batch["i"].tolist())
            if how == "sigstop" and n == 5:
                os.kill(int(batch["pid"][0]), signal.SIGSTOP)
        stats = loader.stats()
        healed = {"restarts": stats.restarts, "crashes": stats.crashes, "hangs": stats.hangs}
    except (aioloader.LoaderTimeoutError, aioloader.WorkerDied) as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
        healed = {}
    finally:
        loader.close()
        from multiprocessing import resource_tracker  # spawn's helper: not a worker

        helper = getattr(resource_tracker._resource_tracker, "_pid", None)
        mine = {helper, hog.pid if hog is not None else None}  # not the loader's
        left = [pid for pid in _workers() if pid not in mine]
        for pid in left:  # a stopped worker that close left behind (the test fails on it)
            os.kill(pid, signal.SIGKILL)
        if hog is not None:
            hog.wait()
    print(json.dumps({"seen": seen, "reference": reference, "error": error, "left": left,
                      **healed}))


if __name__ == "__main__":
    main()
