"""Test-side helpers: consuming a loader under a deadline, watching processes, scripts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aioloader
from aioloader.testing import descendants, is_alive, is_helper

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")


async def acollect(aiterable: Any, limit: int | None = None, timeout: float = 30.0) -> list[Any]:
    async def run() -> list[Any]:
        out: list[Any] = []
        async for item in aiterable:
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
        return out

    return await asyncio.wait_for(run(), timeout)


def consume(loader: aioloader.DataLoader, consumer: str, limit: int | None = None) -> list[Any]:
    """One epoch (or ``limit`` batches) with ``async for`` or plain ``for``."""
    if consumer == "async":
        return asyncio.run(acollect(loader, limit))
    out: list[Any] = []
    for batch in loader:
        out.append(batch)
        if limit is not None and len(out) >= limit:
            break
    return out


def workers(root: int | None = None) -> list[int]:
    """Live descendants that are not multiprocessing's long-lived helpers."""
    return [p for p in descendants(root) if not is_helper(p)]


def survivors(deadline: float, root: int | None = None, pids: list[int] | None = None,
              ) -> list[int]:
    """Loader processes still alive after ``deadline`` seconds (polling /proc)."""
    end = time.monotonic() + deadline
    while True:
        left = [p for p in (pids if pids is not None else workers(root)) if is_alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.02)


def script_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_script(name: str, *args: object, prefix: list[str] | None = None,
                 ) -> subprocess.Popen[bytes]:
    cmd = [*(prefix or []), sys.executable, os.path.join(SCRIPTS, name), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=script_env(), start_new_session=True)


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> Any:
    """The script's next stdout line, parsed as JSON, waiting at most ``timeout``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no output line from the script within {timeout}s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1)  # byte by byte: what follows the line stays in the pipe
            if not chunk:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise AssertionError(f"script ended before reporting (rc={proc.wait()}):\n"
                                     f"{err[-3000:]}")
            buf += chunk
    return json.loads(buf)


def finish(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, str, str]:
    """Wait for the script; kill its whole tree if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"script did not finish within {timeout}s (hang?):\n"
                             f"{err.decode(errors='replace')[-3000:]}") from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def kill_9(proc: subprocess.Popen[bytes], tree: list[int], bound: float,
           ) -> tuple[list[int], float]:
    """SIGKILL the consumer ``proc``, then wait up to ``bound`` seconds for ``tree`` (its
    descendants, listed before the kill) to go: the pids left, and how long they took.
    The caller kills what is left once it has reported it."""
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = survivors(bound, pids=tree)
    return left, time.monotonic() - t0


@contextlib.contextmanager
def ended(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``proc``, killed if still running, waited for and its pipes closed when the block
    ends."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def cpu_hog(n: int) -> Iterator[None]:
    """``n`` processes that each spin on a core for the block: a loaded machine."""
    hogs = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"])
            for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


class StallReports:
    """A FIFO that ``victims.Stalls`` workers write their pid to as they stall."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "stalled")
        os.mkfifo(self.path)
        self._read = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # Our own writer: without one, a FIFO nobody writes to reads as EOF at once.
        self._keep = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._buf = b""

    def wait(self, count: int, timeout: float = 60.0) -> list[int]:
        """The pids of the first ``count`` distinct workers to stall, waiting on the FIFO."""
        deadline = time.monotonic() + timeout
        pids: list[int] = []
        while len(pids) < count:
            lines = self._buf.split(b"\n")
            self._buf = lines.pop()
            pids += [p for p in map(int, filter(None, lines)) if p not in pids]
            if len(pids) >= count:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"only {pids} of {count} workers stalled in {timeout}s")
            if select.select([self._read], [], [], left)[0]:
                self._buf += os.read(self._read, 4096)
        return pids

    def close(self) -> None:
        os.close(self._read)
        os.close(self._keep)


async def arena_full(loader: aioloader.DataLoader, timeout: float = 60.0) -> list[int]:
    """The worker pids, once every slot of every worker holds a batch the consumer has not
    taken, so that each waits for a free one. Checked on the loop's turns: the parent's
    account of the slots changes there, and there is nothing else to wait on."""
    deadline = time.monotonic() + timeout
    while (stats := loader.stats()).arena.free > 0 or not stats.workers:
        if time.monotonic() > deadline:
            raise AssertionError(f"the arena did not fill in {timeout}s: {stats.arena}")
        await asyncio.sleep(0.01)
    return [w.pid for w in stats.workers if w.pid is not None]
