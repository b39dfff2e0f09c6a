"""Telemetry: what a loader did, as a typed snapshot; the one number is the data stall.

Counters are kept as the work happens (two clock reads per batch on the consumer's side,
the worker's busy time riding on each batch message), so that ``loader.stats()`` only
reads them: cheap enough to call every step (issue 12).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerStats:
    """One worker process, from its start to its latest batch: ``batches_per_s`` it handed
    over, and ``busy``, the share of that time it spent building batches (the rest it
    waited for a free slot, or for work). ``node``: the Ray node of a Ray worker's actor."""

    worker: int
    pid: int | None
    batches: int
    batches_per_s: float
    busy: float
    node: str | None = None  # worker_type="ray": the Ray node its actor runs on


@dataclass(frozen=True)
class ArenaStats:
    """The workers' shared-memory slots now: ``filled`` hold batches not yet taken,
    ``leased`` hold batches the consumer still uses (zero-copy), the rest are free."""

    slots: int
    free: int
    filled: int
    leased: int
    bytes: int


@dataclass(frozen=True)
class LoaderStats:
    """A loader's telemetry, from :meth:`DataLoader.stats() <aioloader.DataLoader.stats>`.

    ``wait_s``: time the consumer spent waiting inside the loader for a batch; ``wall_s``:
    time its epochs ran; ``data_stall`` = ``wait_s / wall_s``, the share of the step time
    lost to data. Above a few percent, the loader is the bottleneck: raise ``num_workers``
    (or the concurrency of the source). ``workers``: the current ones; ``restarts``: deaths
    healed (``max_worker_restarts``), of which ``crashes`` ended on their own (a signal,
    ``os._exit``, out of memory) and ``hangs`` went silent past ``timeout`` with a batch
    owed and were killed; ``padded``: batches a rank repeated to keep the ranks in step
    under ``even_batches`` (a cached reader's as planned, a stream's as handed over; see the
    guide's "Uneven shards").
    """

    batches: int
    bytes: int
    wait_s: float
    wall_s: float
    data_stall: float
    time_to_first_batch_s: float | None
    workers: tuple[WorkerStats, ...]
    arena: ArenaStats
    restarts: int
    recycles: int
    skipped: int = 0  # keys skipped on error (on_error="skip"): loader.skipped
    padded: int = 0  # batches repeated to keep the ranks in step (even_batches)
    crashes: int = 0
    hangs: int = 0

    def __str__(self) -> str:
        first = ("-" if self.time_to_first_batch_s is None
                 else f"{self.time_to_first_batch_s:.2f} s")
        workers = ", ".join(f"w{w.worker} {w.batches_per_s:.1f}/s {w.busy:.0%} busy"
                            for w in self.workers) or "in-process"
        arena = self.arena
        return (f"{self.batches} batches ({_size(self.bytes)}), data stall "
                f"{self.data_stall:.1%} (waited {self.wait_s:.1f} s of {self.wall_s:.1f} s), "
                f"first batch {first}; workers: {workers}; arena {arena.slots} slots "
                f"({arena.free} free, {arena.filled} filled, {arena.leased} leased, "
                f"{_size(arena.bytes)}); restarts {self.restarts} ({self.crashes} crashes, "
                f"{self.hangs} hangs), recycles {self.recycles}"
                + (f", padded {self.padded}" if self.padded else ""))


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


NO_ARENA = ArenaStats(0, 0, 0, 0, 0)


class Meter:
    """The consumer's side: batches handed over, and how long it waited for them."""

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0
        self.wait = 0.0
        self.first: float | None = None  # time to the first batch of the latest epoch
        self._wall = 0.0  # of the epochs that ended
        self._since: float | None = None  # the running epoch's start
        self._awaiting_first = False

    def epoch_began(self, now: float) -> None:
        self.epoch_ended(now)  # one dropped half-way ran until now
        self._since = now
        self._awaiting_first = True

    def epoch_ended(self, now: float) -> None:
        if self._since is not None:
            self._wall += now - self._since
            self._since = None

    def handed(self, began: float, now: float, nbytes: int) -> None:
        """A batch handed over at ``now``; the consumer had asked for it at ``began``."""
        self.batches += 1
        self.bytes += nbytes
        self.wait += now - began
        if self._awaiting_first and self._since is not None:
            self.first = now - self._since
            self._awaiting_first = False

    def wall(self) -> float:
        """The epochs' wall time, the running one's so far included."""
        running = time.monotonic() - self._since if self._since is not None else 0.0
        return self._wall + running


def stats_to_stderr() -> None:
    """``log_every`` asks for the lines: make sure they show even where logging is not set
    up (Python shows warnings only by default). Configure ``aioloader.stats`` to route them."""
    log = logging.getLogger("aioloader.stats")
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():  # nothing up the tree would print it
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
