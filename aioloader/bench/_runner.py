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
from ._measure import Face, LoopName, Result, Spec, measure
from ._workloads import LAG, WORKLOADS, CollateChoice

LAG_SIDES = ("aioloader", "torch-direct", "torch-executor")
ZERO = "aioloader@0"  # aioloader with num_workers=0 (the tiny workload's extra reference)


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
            payload: dict[str, Any] = {"result": fn(*args)}
        except BaseException:  # noqa: BLE001 - the parent reports it
            payload = {"error": traceback.format_exc()}
        data = json.dumps(payload).encode()
        while data:
            data = data[os.write(write_fd, data):]
    except BaseException:  # noqa: BLE001 - a measurement child must always exit
        code = 1
    finally:
        os._exit(code)  # no atexit handlers or buffers of the parent's run twice


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
    return f"{spec.workload} / {spec.side} (num_workers={spec.num_workers})"


def sides(workload: str, num_workers: int, peers: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The sides measured for ``workload``, in the order each pair runs them."""
    if workload == LAG:
        return LAG_SIDES
    if workload == "tiny" and num_workers > 0:
        return ("aioloader", "torch", ZERO, *peers)
    return ("aioloader", "torch", *peers)


def spec_for(plan: Plan, workload: str, side: str) -> Spec:
    base = Spec(kind="lag" if workload == LAG else "throughput", side=side, workload=workload,
                num_workers=plan.num_workers, start_method=plan.start_method,
                batches=plan.batches[workload], face=plan.face, loop=plan.loop,
                collate=plan.collate)
    if side == ZERO:
        return replace(base, side="aioloader", num_workers=0)
    return base


def run_workload(plan: Plan, workload: str,
                 on_run: Callable[[str, int], None] | None = None) -> dict[str, list[Result]]:
    """Every side of ``workload``, alternating (A B A B ...), ``plan.pairs`` times."""
    runs: dict[str, list[Result]] = {
        side: [] for side in sides(workload, plan.num_workers, plan.peers)}
    for pair in range(plan.pairs):
        for side, results in runs.items():
            if on_run is not None:
                on_run(side, pair)
            results.append(isolated(spec_for(plan, workload, side), plan.timeout))
    return runs


def default_batches(quick: bool) -> dict[str, int]:
    """Batches per epoch of each workload; ``quick`` keeps just enough to exercise each."""
    batches = {name: w.batches for name, w in WORKLOADS.items()}
    batches[LAG] = batches["image"]
    if quick:
        batches = {name: max(3, n // 25) for name, n in batches.items()}
    return batches
