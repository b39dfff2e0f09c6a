"""Runs each measurement in a fresh forked process and alternates the sides in pairs."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..testing import members
from ._first import measure
from ._measure import Face, Kind, LoopName, Result, Spec
from ._step import FETCH, SIDE, fetch_ms, matmul_ms, reps_for
from ._workloads import FIRST, FIRST_BATCHES, LAG, WORKLOADS, CollateChoice

LAG_SIDES = ("aioloader", "torch-direct", "torch-executor")
ZERO = "aioloader@0"  # aioloader with num_workers=0 (the tiny workload's extra reference)
PROCESS = "aioloader@process"  # --worker-type ray: aioloader with worker processes, beside
# --lag: a throughput workload's lag runs, in the same pairs as its throughput runs
LAGGED = "lag:"  # prefix of those sides
LAGGED_SIDES = (f"{LAGGED}aioloader", f"{LAGGED}torch-direct")
LAG_MIN_S = 1.0  # each lag run streams epochs for at least this long (--quick: a tenth)


class MeasurementError(Exception):
    """A measurement raised, died or ran past its deadline; the message says which."""


@dataclass(frozen=True)
class Plan:
    """The options of one bench invocation that every measurement shares."""

    num_workers: int
    start_method: str
    pairs: int
    batches: dict[str, int]  # per workload, per epoch
    face: Face
    loop: LoopName
    timeout: float  # seconds one measurement may take
    peers: tuple[str, ...] = ()  # of _peers.PEERS: measured too, in every pair
    collate: CollateChoice = "none"
    lag: bool = False  # also a 1 ms ticker's lag beside each throughput workload (--lag)
    lag_min_s: float = LAG_MIN_S
    worker_nice: int | None = None  # aioloader's worker processes only (--worker-nice);
    # None: the loader's default
    worker_type: str = "process"  # aioloader's, on the throughput workloads (--worker-type)
    step_ms: float | str | None = None  # --step-ms: ms, "fetch" (each workload's), or none
    step_threads: int = 0  # --step-threads: the step's intra-op threads (0: torch's)


def isolated(spec: Spec, timeout: float) -> Result:
    """``measure(spec)`` in a forked child of this process, in its own process group."""
    return isolated_call(measure, (spec,), timeout, _describe(spec))


def isolated_call(fn: Callable[..., Result], args: tuple[Any, ...], timeout: float,
                  what: str) -> Result:
    """``fn(*args)`` in a forked child of this process, in its own process group.

    Forking rather than starting a fresh interpreter spares each run the import of torch
    (seconds on a small machine); the child still has its own peak RSS, CPU clock and
    children. Whatever it leaves behind in its group is killed before this returns.
    ``what`` names the run in errors.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child(fn, args, read_fd, write_fd)
    os.close(write_fd)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first wins the race
    try:
        data = _read_until_eof(read_fd, time.monotonic() + timeout)
        _, status = os.waitpid(pid, 0)
    except TimeoutError:
        _kill_group(pid)
        os.waitpid(pid, 0)
        raise MeasurementError(f"{what} ran past {timeout:.0f} s; killed") from None
    except BaseException:  # KeyboardInterrupt included: the child and its workers go too
        _kill_group(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read_fd)
    leftovers = _reap_group(pid)
    if not data:
        raise MeasurementError(f"{what} died without a result ({_exit_reason(status)})")
    payload: dict[str, Any] = json.loads(data)
    if "error" in payload:
        raise MeasurementError(f"{what} raised:\n{payload['error']}")
    result: Result = payload["result"]
    # multiprocessing's own helpers (spawn's resource tracker, the fork server) exit once the
    # child is gone, a moment later: not something a loader left behind
    leftovers = [pid for pid in leftovers if pid not in payload.get("helpers", ())]
    if leftovers:
        result["leftover_pids"] = leftovers
    return result


def _child(fn: Callable[..., Result], args: tuple[Any, ...], read_fd: int,
           write_fd: int) -> None:  # pragma: no cover - the child
    code = 0
    try:
        os.close(read_fd)
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            payload: dict[str, Any] = {"result": fn(*args), "helpers": _mp_helpers()}
        except BaseException:  # noqa: BLE001 - the parent reports it
            payload = {"error": traceback.format_exc()}
        data = json.dumps(payload).encode()
        while data:
            data = data[os.write(write_fd, data):]
    except BaseException:  # noqa: BLE001 - a measurement child must always exit
        code = 1
    finally:
        os._exit(code)  # no atexit handlers or buffers of the parent's run twice


def _mp_helpers() -> list[int]:  # pragma: no cover - the child
    """Pids of the helper processes multiprocessing started in this process, if any."""
    from multiprocessing import forkserver, resource_tracker

    pids = [getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)]
    return [pid for pid in pids if isinstance(pid, int)]


def _read_until_eof(fd: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _reap_group(pgid: int, grace: float = 5.0) -> list[int]:
    """Give what the child left in its group ``grace`` seconds to exit, then kill it.

    Returns the pids that were still there at the first look (a loader that did not clean
    up after itself).
    """
    first = members(group=pgid)
    deadline = time.monotonic() + grace
    left = first
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # workers we did not start and cannot wait on: look again shortly
        left = members(group=pgid)
    if left:
        _kill_group(pgid)
    return first


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _describe(spec: Spec) -> str:
    if spec.kind == "refs":
        return "the reference measurement"
    what = " (with a 1 ms ticker)" if spec.kind == "lag" and spec.workload != LAG else ""
    return f"{spec.workload} / {spec.side}{what} (num_workers={spec.num_workers})"


def sides(workload: str, num_workers: int, peers: tuple[str, ...] = (),
          lag: bool = False, worker_type: str = "process") -> tuple[str, ...]:
    """The sides measured for ``workload``, in the order each pair runs them; with ``lag``,
    a throughput workload's lag runs too (``LAGGED_SIDES``); with Ray workers, aioloader
    with worker processes too (``PROCESS``), in the same pairs."""
    if workload == LAG:
        return LAG_SIDES
    if workload == FIRST:
        return ("aioloader", "torch", *peers)
    lagged = LAGGED_SIDES if lag else ()
    ours = ("aioloader", PROCESS) if worker_type == "ray" and num_workers > 0 else (
        "aioloader",)
    if workload == "tiny" and num_workers > 0:
        return (*ours, "torch", ZERO, *peers, *lagged)
    return (*ours, "torch", *peers, *lagged)


def spec_for(plan: Plan, workload: str, side: str) -> Spec:
    kind: Kind = "lag" if workload == LAG else "first" if workload == FIRST else "throughput"
    base = Spec(kind=kind, side=side, workload=workload,
                num_workers=plan.num_workers, start_method=plan.start_method,
                batches=plan.batches[workload], face=plan.face, loop=plan.loop,
                collate=plan.collate,
                worker_nice=plan.worker_nice if side.removeprefix(LAGGED) == "aioloader" else 0)
    if side == ZERO:
        return replace(base, side="aioloader", num_workers=0, worker_nice=0)
    if side == PROCESS:
        return replace(base, side="aioloader")
    if side == "aioloader" and kind == "throughput" and plan.num_workers > 0:
        return replace(base, worker_type=plan.worker_type,
                       worker_nice=None if plan.worker_type == "ray" else base.worker_nice)
    if side.startswith(LAGGED):  # always `async for`: lag is a property of the event loop
        return replace(base, kind="lag", side=side.removeprefix(LAGGED), face="async",
                       min_s=plan.lag_min_s)
    return base


def run_workload(plan: Plan, workload: str,
                 on_run: Callable[[str, int], None] | None = None) -> dict[str, list[Result]]:
    """Every side of ``workload``, alternating (A B A B ...), ``plan.pairs`` times."""
    runs: dict[str, list[Result]] = {
        side: [] for side in sides(workload, plan.num_workers, plan.peers, plan.lag,
                                   plan.worker_type)}
    reps = step_reps(plan, workload)
    for pair in range(plan.pairs):
        for side, results in runs.items():
            if on_run is not None:
                on_run(side, pair)
            spec = spec_for(plan, workload, side)
            if spec.kind == "throughput":
                spec = replace(spec, step_reps=reps, step_threads=plan.step_threads)
            results.append(isolated(spec, plan.timeout))
    return runs


def step_reps(plan: Plan, workload: str) -> int:
    """The consumer step's matmuls after each of ``workload``'s batches (``--step-ms``),
    calibrated here once, so that every side of every pair does the same work."""
    if plan.step_ms is None or workload not in WORKLOADS:
        return 0
    # In a child: torch's OpenMP team started in this process would be forked into every
    # measurement after it.
    times = isolated_call(_calibrate, (workload, plan.step_ms, plan.step_threads), plan.timeout,
                          f"{workload}'s consumer step")
    one, ms = times["matmul_ms"], times["step_ms"]
    reps = reps_for(ms, one)
    on = f" on {plan.step_threads} thread(s)" if plan.step_threads else ""
    print(f"  ({workload}: consumer step {reps} matmul(s) of {SIDE}x{SIDE}{on}, "
          f"{reps * one:.2f} ms, for {ms:.2f} ms asked)", file=sys.stderr, flush=True)
    return reps


def default_batches(quick: bool) -> dict[str, int]:
    """Batches per epoch of each workload; ``quick`` keeps just enough to exercise each."""
    batches = {name: w.batches for name, w in WORKLOADS.items()}
    batches[LAG] = batches["image"]
    if quick:
        batches = {name: max(3, n // 25) for name, n in batches.items()}
    batches[FIRST] = FIRST_BATCHES  # one is consumed; the epoch's size hardly matters
    return batches


def _calibrate(workload: str, step_ms: float | str,
               threads: int) -> Result:  # pragma: no cover - a child
    return {"matmul_ms": matmul_ms(threads), "step_ms": fetch_ms(WORKLOADS[workload])
            if step_ms == FETCH else float(step_ms)}
