"""One measurement in the current process: throughput, loop lag, time to the first batch, or
the machine's references."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import random
import resource
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.utils.data

import aioloader

from ._peers import Setup, open_loader, torch_loader
from ._step import consumer_step
from ._workloads import WORKLOADS, CollateChoice, Workload, lag_workload

T = TypeVar("T")
Result = dict[str, Any]
Kind = Literal["throughput", "lag", "first", "refs"]
Face = Literal["async", "sync"]
LoopName = Literal["asyncio", "uvloop"]
TICK = 0.001  # the loop-lag ticker's period, seconds
WAKES_PER_S = 1000  # the floor's wake-ups: about a fast workload's batches a second
EPOCHS = 2  # throughput runs span an epoch boundary
LAG_MAX_EPOCHS = 50  # a lag run streams epochs until ``Spec.min_s`` has passed, at most these


@dataclass(frozen=True)
class Spec:
    """What one isolated run measures.

    ``side`` is "aioloader", "torch" or one of ``_peers.PEERS``; for the loop-lag runs also
    "torch-direct" (torch's iterator driven inside the loop) or "torch-executor"
    (``loop.run_in_executor(None, next, it)``). A lag run streams ``workload`` (image's
    batches for "loop-lag"), epoch after epoch until ``min_s`` seconds have passed (one epoch
    when 0). A "first" run times a fresh loader of tiny samples to its first batch.
    """

    kind: Kind
    side: str = "aioloader"
    workload: str = "tiny"
    num_workers: int = 2
    start_method: str = "fork"
    batches: int = 10  # per epoch
    face: Face = "async"
    loop: LoopName = "asyncio"
    collate: CollateChoice = "none"
    min_s: float = 0.0  # lag runs: stream at least this long
    worker_nice: int | None = None  # aioloader's (--worker-nice; None: its default); the
    # peers run as they are
    worker_type: str = "process"  # aioloader's: "ray" runs its workers as Ray actors
    step_reps: int = 0  # the consumer's step after each batch: matmuls (``_step``)
    step_threads: int = 0  # on this many intra-op threads (0: torch's)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


def measure_here(spec: Spec) -> Result:
    """Run ``spec`` (any kind but "first", which ``_first`` builds on this module) here and
    return its figures (plain JSON-able numbers)."""
    if spec.kind == "refs":
        return references(spec.loop)
    if spec.kind == "lag":
        return run_on(spec.loop, _loop_lag(spec))
    return _throughput(spec)


# ---------------------------------------------------------------------------- throughput

@dataclass
class Clock:
    """When each batch arrived, the main process's CPU time then, and the bytes it held."""

    start: float = field(default_factory=time.perf_counter)
    stamps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)  # the process's minor page faults
    epoch_ends: list[int] = field(default_factory=list)
    nbytes: int = 0
    data_stall: float | None = None  # aioloader's own figure, from loader.stats()

    def arrived(self, batch: Any) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        self.nbytes += _nbytes(batch)

    def epoch_end(self) -> None:
        self.epoch_ends.append(len(self.stamps))

    def figures(self) -> Result:
        n = len(self.stamps)
        if n < 2:
            raise RuntimeError(f"only {n} batch(es) arrived; need at least 2 to time a run")
        window = self.stamps[-1] - self.stamps[0]
        rate = (n - 1) / window
        gaps = sorted(b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False))
        out: Result = {
            "batches": n,
            "batches_per_s": rate,
            "mb_per_s": self.nbytes / n * rate / 1e6,
            "ttfb_ms": (self.stamps[0] - self.start) * 1e3,
            "cpu_ms_per_batch": (self.cpu[-1] - self.cpu[0]) / (n - 1) * 1e3,
            # A count, not a time: what fresh memory costs (~2 us a 4 KiB page here),
            # unmoved by the machine's load.
            "faults_per_batch": (self.faults[-1] - self.faults[0]) / (n - 1),
            "gap_p50_ms": percentile(gaps, 50) * 1e3,
        }
        if self.data_stall is not None:
            out["data_stall_pct"] = self.data_stall * 100
        if len(self.epoch_ends) > 1 and 0 < self.epoch_ends[0] < n:
            last = self.epoch_ends[0]
            out["stall_ms"] = (self.stamps[last] - self.stamps[last - 1]) * 1e3
        return out


def _throughput(spec: Spec) -> Result:
    workload = WORKLOADS[spec.workload]
    dataset = workload.dataset(spec.batches * workload.batch_size)
    with _ray_for(spec):
        gc.collect()
        rss = _PeakRss()
        clock = per_side(spec, workload, dataset, peer=_peer_epochs, sync=_aio_sync_epochs,
                         aio=_aio_async_epochs)
    return {**clock.figures(), "peak_rss_mb": rss.growth_mb()}


@contextlib.contextmanager
def _ray_for(spec: Spec) -> Iterator[None]:
    """A local Ray for a run with Ray workers, started before its clock (its start is
    seconds, and no loader's) and shut down after, so that the run leaves no process."""
    if spec.side != "aioloader" or spec.worker_type != "ray":
        yield
        return
    import ray

    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def per_side(spec: Spec, workload: Workload, dataset: Any, *,
             peer: Callable[[Spec, Workload, Any], T],
             sync: Callable[[Spec, Workload, Any], T],
             aio: Callable[[Spec, Workload, Any], Coroutine[Any, Any, T]]) -> T:
    """One measurement of ``spec.side``: a peer's loader, or aioloader through the face
    ``spec.face`` asks for (``for``, or ``async for`` on a loop of ``spec.loop``'s kind)."""
    if spec.side != "aioloader":
        return peer(spec, workload, dataset)
    if spec.face == "sync":
        return sync(spec, workload, dataset)
    return run_on(spec.loop, aio(spec, workload, dataset))


def _peer_epochs(spec: Spec, workload: Workload, dataset: Any) -> Clock:
    step = consumer_step(spec.step_reps, spec.step_threads)
    clock = Clock()
    with open_loader(spec.side, dataset, peer_setup(spec, workload)) as loader:
        _epochs(clock, loader, step)
        del loader  # torch's persistent workers stop with the loader's last reference
    return clock


def _aio_sync_epochs(spec: Spec, workload: Workload, dataset: Any) -> Clock:
    step = consumer_step(spec.step_reps, spec.step_threads)
    clock = Clock()
    with aio_loader(spec, workload, dataset) as loader:
        _epochs(clock, loader, step)
        clock.data_stall = loader.stats().data_stall
    return clock


def _epochs(clock: Clock, loader: Iterable[Any], step: Callable[[], None]) -> None:
    for _ in range(EPOCHS):
        for batch in loader:
            clock.arrived(batch)
            step()
        clock.epoch_end()


async def _aio_async_epochs(spec: Spec, workload: Workload, dataset: Any) -> Clock:
    step = consumer_step(spec.step_reps, spec.step_threads)
    clock = Clock()
    async with aio_loader(spec, workload, dataset) as loader:
        for _ in range(EPOCHS):
            async for batch in loader:
                clock.arrived(batch)
                step()
            clock.epoch_end()
        clock.data_stall = loader.stats().data_stall
    return clock


def aio_loader(spec: Spec, workload: Workload, dataset: Any) -> aioloader.DataLoader[Any]:
    collate, _ = workload.collates(spec.collate)
    return aioloader.DataLoader(
        dataset, batch_size=workload.batch_size, num_workers=spec.num_workers,
        start_method=spec.start_method, collate_fn=collate, quiet=True, seed=0,
        worker_nice=spec.worker_nice, worker_type=spec.worker_type,
        persistent_workers=spec.num_workers > 0)  # as the torch peer's (_peers.py)


def peer_setup(spec: Spec, workload: Workload) -> Setup:
    """What torch and the other peers get: the same workers, batches and start method."""
    _, collate = workload.collates(spec.collate)
    return Setup(batch_size=workload.batch_size, num_workers=spec.num_workers,
                 start_method=spec.start_method, collate=collate)


# ------------------------------------------------------------------------------ loop lag

async def _loop_lag(spec: Spec) -> Result:
    """How late a 1 ms ticker in the consuming loop wakes while ``spec.workload`` streams,
    and at worst before its first batch (the loader starting)."""
    workload = lag_workload(spec.workload)
    dataset = workload.dataset(spec.batches * workload.batch_size)
    ticks: list[tuple[float, float]] = []  # (wake time, lateness)
    ticker = asyncio.create_task(_tick(ticks))
    await asyncio.sleep(0.01)
    clock = Clock()
    try:
        if spec.side == "aioloader":
            async with aio_loader(spec, workload, dataset) as loader:
                while not _streamed_enough(clock, spec):
                    async for batch in loader:
                        clock.arrived(batch)
                    clock.epoch_end()
        elif spec.side == "torch-direct":
            torch_direct = torch_loader(dataset, peer_setup(spec, workload))
            while not _streamed_enough(clock, spec):
                for batch in torch_direct:
                    clock.arrived(batch)
                    await asyncio.sleep(0)  # what people do: let other tasks run between batches
                clock.epoch_end()
            del torch_direct
        elif spec.side == "torch-executor":
            loop = asyncio.get_running_loop()
            torch_exec = torch_loader(dataset, peer_setup(spec, workload))
            while not _streamed_enough(clock, spec):
                it = iter(torch_exec)
                while (batch := await loop.run_in_executor(None, next, it, None)) is not None:
                    clock.arrived(batch)
                clock.epoch_end()
                del it
            del torch_exec
        else:
            raise ValueError(f"unknown loop-lag side {spec.side!r}")
    finally:
        ticker.cancel()
    gc.collect()
    first, last = clock.stamps[0], clock.stamps[-1]
    # While batches stream: ticks that went to sleep once the first batch was there. The
    # ones that slept before it measure how long starting the loader held the loop.
    lags = sorted(lag for at, lag in ticks if first <= at - TICK - lag and at <= last)
    start = [lag for at, lag in ticks if at - TICK - lag < first]
    if not lags:  # the loop never ran the ticker while batches arrived: one long block
        lags = [last - first]
    figures = clock.figures()
    return {
        "batches": figures["batches"],
        "batches_per_s": figures["batches_per_s"],
        "mb_per_s": figures["mb_per_s"],
        "epochs": len(clock.epoch_ends),
        "ticks": len(lags),
        **lag_figures(lags),
        "start_lag_ms": max(start, default=0.0) * 1e3,
    }


def _streamed_enough(clock: Clock, spec: Spec) -> bool:
    """Whether a lag run has streamed an epoch and ``spec.min_s`` seconds (or its cap)."""
    epochs = len(clock.epoch_ends)
    if epochs == 0:
        return False
    return (epochs >= LAG_MAX_EPOCHS or len(clock.stamps) < 2
            or clock.stamps[-1] - clock.stamps[0] >= spec.min_s)


async def _tick(out: list[tuple[float, float]]) -> None:
    while True:
        before = time.perf_counter()
        await asyncio.sleep(TICK)
        now = time.perf_counter()
        out.append((now, max(0.0, now - before - TICK)))


def lag_figures(lags: list[float]) -> Result:
    """p50/p99/max of sorted lateness values, in ms."""
    return {"lag_p50_ms": percentile(lags, 50) * 1e3, "lag_p99_ms": percentile(lags, 99) * 1e3,
            "lag_max_ms": lags[-1] * 1e3}


# ---------------------------------------------------------------------------- references

def references(loop: LoopName) -> Result:
    """The machine's yardsticks: memcpy bandwidth, a pipe round trip, an idle ticker, and a
    ticker whose loop another process wakes (the loop's own floor)."""
    pipe_us = pipe_round_trip_us()
    idle = run_on(loop, _ticks(300))
    woken = run_on(loop, _woken_ticks(WAKES_PER_S, 2000))
    return {
        "cpu_count": os.cpu_count() or 0,
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "aioloader": aioloader.__version__,
        "memcpy_gbps": memcpy_gbps(),
        "pipe_rtt_us": pipe_us,
        "idle_lag_p50_ms": percentile(idle, 50) * 1e3,
        "idle_lag_p99_ms": percentile(idle, 99) * 1e3,
        "woken_lag_p50_ms": percentile(woken, 50) * 1e3,
        "woken_lag_p99_ms": percentile(woken, 99) * 1e3,
    }


def memcpy_gbps(size: int = 64 << 20, repeats: int = 8) -> float:
    """Single-thread copy bandwidth: torch ``copy_`` into a preallocated tensor, best of N."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return size / best / 1e9


def pipe_round_trip_us(rounds: int = 2000, repeats: int = 3) -> float:
    """One byte there and back between two processes over ``os.pipe``, best of N, in µs."""
    there_r, there_w = os.pipe()
    back_r, back_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the echo: reads until EOF
        try:
            os.close(there_w)
            os.close(back_r)
            while os.read(there_r, 1):
                os.write(back_w, b"x")
        finally:
            os._exit(0)
    os.close(there_r)
    os.close(back_w)
    best = math.inf
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(rounds):
                os.write(there_w, b"x")
                os.read(back_r, 1)
            best = min(best, (time.perf_counter() - start) / rounds)
    finally:
        os.close(there_w)
        os.waitpid(pid, 0)
        os.close(back_r)
    return best * 1e6


async def _ticks(count: int) -> list[float]:
    """The lateness of ``count`` ticks of a 1 ms ticker on this loop, sorted."""
    ticks: list[tuple[float, float]] = []
    ticker = asyncio.create_task(_tick(ticks))
    try:
        while len(ticks) < count:
            await asyncio.sleep(0.05)
    finally:
        ticker.cancel()
    return sorted(lag for _, lag in ticks)


async def _woken_ticks(per_s: float, count: int) -> list[float]:
    """A 1 ms ticker's lateness while another process writes a byte to a pipe that the loop
    watches, ``per_s`` times a second at random moments, and the loop only reads it: what
    any source of wake-ups costs a ticker on this loop, with no work of its own. asyncio's
    selector sleeps whole milliseconds (epoll's timeout is rounded up), so a timer due
    within the millisecond after a wake-up fires up to 1 ms late."""
    loop = asyncio.get_running_loop()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the waker: until the pipe breaks
        try:
            os.close(read_fd)
            rng = random.Random(0)
            while True:
                time.sleep(rng.expovariate(per_s))
                os.write(write_fd, b"x")
        finally:
            os._exit(0)
    os.close(write_fd)
    loop.add_reader(read_fd, os.read, read_fd, 4096)
    try:
        return await _ticks(count)
    finally:
        loop.remove_reader(read_fd)
        os.close(read_fd)  # the waker's next write fails: it exits
        os.waitpid(pid, 0)


# ------------------------------------------------------------------------------- helpers

def run_on(loop: LoopName, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh loop of the kind asked for."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    return 0


class _PeakRss:
    """Growth of this process's peak resident set from now on, in MB.

    Linux lets a process reset its high-water mark (``echo 5 > /proc/self/clear_refs``); where
    that fails, ``ru_maxrss`` (monotonic since the process started) stands in.
    """

    def __init__(self) -> None:
        self.reset = _reset_hwm()
        self.base_kb = _status_kb("VmRSS") if self.reset else _maxrss_kb()

    def growth_mb(self) -> float:
        peak = _status_kb("VmHWM") if self.reset else _maxrss_kb()
        return max(0, peak - self.base_kb) / 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmHWM") > 0
    except OSError:
        return False


def _status_kb(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _maxrss_kb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux

