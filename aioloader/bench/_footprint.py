"""What a remote run costs the machine: CPU seconds of the server, the run's processes and
the whole machine over a window, and the peak memory growth of the consumer and its workers.

Read from /proc, sampled from a thread (psutil is only a test dependency).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aioloader.testing import members

SAMPLE_S = 0.01  # the memory sampler's period
LIST_EVERY = 5  # samples: how often the sampler looks for new worker processes
Result = dict[str, Any]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def run_pids() -> list[int]:
    """This run's processes: the measuring child leads its own group (``isolated_call``)."""
    return members(group=os.getpgid(0)) or [os.getpid()]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return 0.0
    fields = data[data.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / _TICK


@dataclass
class Busy:
    """CPU seconds of the server, of the run's processes (the client: consumer, workers) and
    of the whole machine, between the first and the last ``mark``."""

    server: int  # its pid
    marks: list[tuple[float, float, float, float]] = field(default_factory=list)

    def mark(self) -> None:
        client = sum(_cpu_s(pid) for pid in run_pids())
        self.marks.append((time.perf_counter(), _cpu_s(self.server), client,
                           _machine_busy_s()))

    def figures(self) -> Result:
        (t0, s0, c0, m0), (t1, s1, c1, m1) = self.marks[0], self.marks[-1]
        wall = max(t1 - t0, 1e-9)
        return {"server_cores": (s1 - s0) / wall, "client_cores": (c1 - c0) / wall,
                "machine_cores": (m1 - m0) / wall}


class Footprint:
    """Peak growth of the run's memory (consumer and workers), sampled from a thread.

    Per sample: the anonymous pages (``RssAnon``) each process holds above this process's
    first sample (workers are forked from it), summed, plus the largest growth of
    shared-memory pages (``RssShmem``: the arena, mapped by the consumer and every worker,
    counted once).
    """

    def __init__(self) -> None:
        self.base: dict[int, tuple[int, int]] = {}
        self.me = os.getpid()
        self.pids = run_pids()
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="footprint", daemon=True)
        self._sample()
        self.thread.start()

    def _run(self) -> None:
        samples = 0
        while not self.stop.wait(SAMPLE_S):
            samples += 1
            if samples % LIST_EVERY == 0:  # listing means reading every /proc/<pid>/stat
                self.pids = run_pids()
            self._sample()

    def _sample(self) -> None:
        anon = shmem = 0
        for pid in self.pids:
            now = _rss_kb(pid)
            if now is None:
                continue
            # a worker forked from this process started from its pages: its growth counts
            # from this process's first sample, however late the sampler first sees it
            base = self.base.setdefault(pid, self.base.get(self.me, now))
            anon += max(0, now[0] - base[0])
            shmem = max(shmem, now[1] - base[1])
        self.peak = max(self.peak, anon + shmem)

    def growth_mb(self) -> float:
        self.stop.set()
        self.thread.join()
        self._sample()
        return self.peak * 1024 / 1e6


def _rss_kb(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssShmem) of ``pid`` in KiB, or None if it is gone."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    key, value = line.split(":", 1)
                    values[key] = int(value.split()[0])
    except OSError:
        return None
    return values.get("RssAnon", 0), values.get("RssShmem", 0)
