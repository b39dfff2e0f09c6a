"""Chaos at scale (issue 33): faults injected at random into live workers and standbys while
epochs run, or the training process itself killed; a report anyone can rerun.

    python scripts/chaos.py faults --crashes 1000 --hangs 200 --methods fork
    python scripts/chaos.py faults --crashes 60 --hangs 10 --methods spawn,forkserver --ray
    python scripts/chaos.py parent --kills 100 --methods fork,spawn,forkserver

``faults``: one loader per start method (a map-style dataset of keys, loaded by a ``load_fn``
with ``Retry``; 2 workers; ``max_worker_restarts`` without a practical bound; ``timeout``
for hangs) is iterated epoch after epoch. After a random 1-6 batches, one fault at a time
is injected, drawn from what is left of the quotas:

- crashes: SIGKILL or SIGSEGV from outside into a random child (a live worker, a spawn
  standby or a successor), ``os._exit(0)`` from user code (the load function) in a worker;
- hangs: SIGSTOP from outside into a live worker (healed after ``timeout`` of silence);
- errors of user code: ``MemoryError`` raised by the load function (not a death: the
  epoch raises it as ``WorkerError``, as the contract says; the next epoch must be exact),
  and transient ``ConnectionResetError`` s that ``Retry`` absorbs.

Every epoch is checked against the fixed order of its batches (exactly once, in order);
recovery is the time from a fault to the next batch built by the replacement (a new pid
for that worker id); leftovers are the processes and ``/dev/shm`` entries the run made.
Once the quotas are spent, epochs go on until the last fault is healed (at most a few).

Hangs are checked both ways: every worker the loader reports hung (its log) must be one
this script stopped; a worker that is merely slow on a loaded machine (runnable, waiting
for a CPU) must not be killed as hung. ``--timeout`` (default 2 s) is the loader's
``timeout``: a stopped worker is healed after that much silence, so a hang's recovery is
about ``timeout`` plus a restart.

``parent``: a training process with workers (and, for spawn, its standbys) is started, then
killed with SIGKILL once its first batch arrived; after ``ORPHAN_GRACE`` (plus a margin for
the exit itself) no process of its session and no ``/dev/shm`` entry it made may be left.

The watchers here poll ``/proc``: a diagnostic script cannot wait on processes that are not
its children (the library itself never polls).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import aioloader
from aioloader.testing import descendants, is_helper, members
from aioloader.workers._worker import ORPHAN_GRACE

N = 96  # keys a pass; batches of BATCH
BATCH = 4
WORKERS = 2
EXPECTED = [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSEGV": signal.SIGSEGV, "SIGSTOP": signal.SIGSTOP}
USER = ("os._exit(0)", "MemoryError", "transient")  # injected from inside the load function
CRASHES = ("SIGKILL", "SIGSEGV", "os._exit(0)")
MARGIN = 3.0  # seconds past ORPHAN_GRACE for the killed parent's workers to be gone


# ------------------------------------------------------------------ the data and its faults

class Keys:
    """A map-style dataset of keys: the work (and the user-code faults) is the load's."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class Load:
    """The load function: ``{"i", "pid", "wid"}``, unless a fault ticket waits in ``box``:
    the first process to rename a ticket into ``taken/`` carries it out (stamped)."""

    def __init__(self, box: str) -> None:
        self.box = box

    def __call__(self, key: int) -> dict[str, Any]:
        tickets = os.listdir(self.box)
        for name in tickets:
            if name == "taken":
                continue
            info = aioloader.get_worker_info()
            wid = info.id if info is not None else -1
            taken = os.path.join(self.box, "taken", f"{name}.{os.getpid()}.{wid}")
            try:
                os.rename(os.path.join(self.box, name), taken)
            except FileNotFoundError:
                continue  # another worker took it
            with open(taken, "w") as f:
                f.write(repr(time.time()))
            kind = name.split(".")[0]
            if kind == "exit0":
                os._exit(0)
            if kind == "memoryerror":
                raise MemoryError("chaos: injected MemoryError")
            if kind == "transient":
                raise ConnectionResetError("chaos: injected transient error")
        info = aioloader.get_worker_info()
        return {"i": key, "pid": os.getpid(), "wid": info.id if info is not None else -1}


def make(method: str, box: str, timeout: float, ray: bool) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        Keys(), batch_size=BATCH, num_workers=WORKERS, start_method=method,
        worker_type="ray" if ray else "process", load_fn=Load(box),
        retries=aioloader.Retry(retries=8, backoff=0.001, max_backoff=0.01,
                                retry_on=(ConnectionResetError,)),
        max_worker_restarts=10**9, timeout=timeout, persistent_workers=True, quiet=True)


# ------------------------------------------------------------------ one run of faults

@dataclass
class Fault:
    kind: str
    at: float
    wid: int | None  # the worker it hit (None: a standby, or not known yet)
    pid: int | None
    restarts: int = 0  # the loader's restarts when it was injected
    wall: float = field(default_factory=time.time)  # as the log's records are stamped
    recovered: float | None = None


@dataclass
class Tally:
    method: str
    epochs: int = 0
    exact: int = 0
    raised_as_expected: int = 0
    bad: list[str] = field(default_factory=list)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    recovery: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    leftovers: list[str] = field(default_factory=list)
    timeout: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after
    stopped: set[int] = field(default_factory=set)  # pids this script SIGSTOPped
    hung: list[str] = field(default_factory=list)  # workers the loader killed as hung
    unrecovered: collections.Counter[str] = field(default_factory=collections.Counter)
    untaken: int = 0  # fault tickets no worker took by the end
    aside: collections.Counter[str] = field(default_factory=collections.Counter)  # standbys
    # replaced with the rest when an epoch failed (an injected MemoryError), not restarted
    renewed: collections.Counter[str] = field(default_factory=collections.Counter)
    # fault to the loader's restart of that worker (its warning), by crash and hang
    restarting: dict[str, list[float]] = field(
        default_factory=lambda: collections.defaultdict(list))


class LoaderLog(logging.Handler):
    """What the loader's warnings say: the workers it reports hung (and kills): the pid of a
    process worker, the name of a Ray actor; when it began to restart each pid."""

    HUNG = re.compile(r"^(?:worker \d+ \(pid (\d+)\)|(.+?)) hung: no (?:word|reply) for")
    RESTART = re.compile(r"^worker \d+ \(pid (\d+)\) .*; restarting it")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hung: list[str] = []
        self.restarted: dict[int, float] = {}  # pid: the record's time (time.time())

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if (found := self.HUNG.match(message)) and "killing" in message:
            self.hung.append(found.group(1) or found.group(2))
        elif found := self.RESTART.match(message):
            self.restarted[int(found.group(1))] = record.created


def _children() -> list[int]:
    return [p for p in descendants() if not is_helper(p)]


def _worker_pids(loader: aioloader.DataLoader) -> dict[int, int]:
    return {w.worker: w.pid for w in loader.stats().workers if w.pid is not None}


class Injector:
    """Draws the next fault from the quotas left and carries it out."""

    def __init__(self, box: str, crashes: int, hangs: int, errors: int, ray: bool,
                 rng: random.Random) -> None:
        self.box = box
        self.rng = rng
        self.ray = ray
        crash_kinds = ("SIGKILL", "os._exit(0)") if ray else CRASHES  # no pid to signal
        self.left: collections.Counter[str] = collections.Counter()
        for n in range(crashes):
            self.left[crash_kinds[n % len(crash_kinds)]] += 1
        if not ray:
            self.left["SIGSTOP"] = hangs
        self.left["MemoryError"] = errors
        self.left["transient"] = errors
        self.serial = 0
        self.stopped: set[int] = set()

    def done(self) -> bool:
        return not +self.left

    def inject(self, loader: aioloader.DataLoader) -> Fault | None:
        kinds = list((+self.left).elements())
        kind = self.rng.choice(kinds)
        workers = _worker_pids(loader)
        if kind in SIGNALS:
            pool = list(workers.items())
            others = [p for p in _children() if p not in workers.values()]
            if kind != "SIGSTOP" and others and not self.ray and self.rng.random() < 0.2:
                pid, wid = self.rng.choice(others), None  # a standby or a successor
            elif pool:
                wid, pid = self.rng.choice(pool)
            else:
                return None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, SIGNALS[kind])
                if kind == "SIGSTOP":
                    self.stopped.add(pid)
        else:
            self.serial += 1
            ticket = {"os._exit(0)": "exit0", "MemoryError": "memoryerror",
                      "transient": "transient"}[kind]
            Path(self.box, f"{ticket}.{self.serial}").touch()
            wid = pid = None  # whoever takes it: read from the ticket when it is taken
        self.left[kind] -= 1
        return Fault(kind, time.monotonic(), wid, pid, loader.stats().restarts)


def _taken_by(box: str, kind: str) -> tuple[int, int] | None:
    """(pid, worker id) of the process that took the latest ticket of ``kind``."""
    prefix = {"os._exit(0)": "exit0", "MemoryError": "memoryerror",
              "transient": "transient"}[kind]
    for name in os.listdir(os.path.join(box, "taken")):
        if name.startswith(prefix + "."):
            _, _, pid, wid = name.split(".")
            os.remove(os.path.join(box, "taken", name))
            return int(pid), int(wid)
    return None


async def run_faults(method: str, crashes: int, hangs: int, errors: int, timeout: float,
                     ray: bool, seed: int, max_seconds: float) -> Tally:
    tally = Tally(method + (" (ray)" if ray else ""), timeout=timeout)
    rng = random.Random(seed)
    shm_before = set(os.listdir("/dev/shm"))
    hang_log = LoaderLog()
    logging.getLogger("aioloader").addHandler(hang_log)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aioloader-chaos-") as box:
        os.mkdir(os.path.join(box, "taken"))
        injector = Injector(box, crashes, hangs, errors, ray, rng)
        loader = make(method, box, timeout, ray)
        pending: Fault | None = None
        expect_errors = 0  # MemoryError tickets waiting: as many epochs raise them
        settling = 0  # epochs after the last fault, for it to heal
        try:
            while (not injector.done() and time.monotonic() - started < max_seconds) or (
                    (pending is not None or expect_errors) and settling < 3):
                if injector.done() or time.monotonic() - started >= max_seconds:
                    settling += 1
                seen: list[list[int]] = []
                countdown = rng.randint(1, 6)
                tally.epochs += 1
                try:
                    async for batch in loader:
                        now = time.monotonic()
                        seen.append(batch["i"].tolist())
                        if pending is not None and pending.wid is None and pending.pid is None:
                            got = _taken_by(box, pending.kind)
                            if got is not None:
                                pending.pid, pending.wid = got
                        if pending is not None and pending.wid is not None and (
                                int(batch["wid"][0]) == pending.wid
                                and int(batch["pid"][0]) != pending.pid):
                            pending.recovered = now
                        if pending is not None and (pending.recovered is not None or now -
                                                    pending.at > 10 * timeout + 30):
                            if pending.recovered is not None and (
                                    loader.stats().restarts == pending.restarts):
                                tally.renewed[pending.kind] += 1  # no restart: not timed
                            elif pending.recovered is not None:
                                tally.recovery[pending.kind].append(pending.recovered -
                                                                    pending.at)
                                if pending.pid in hang_log.restarted:
                                    tally.restarting[
                                        "hang" if pending.kind == "SIGSTOP" else "crash"
                                    ].append(hang_log.restarted[pending.pid] - pending.wall)
                            else:
                                tally.unrecovered[pending.kind] += 1
                            pending = None
                        countdown -= 1
                        if (pending is None and countdown <= 0 and not injector.done()
                                and time.monotonic() - started < max_seconds):
                            pending = injector.inject(loader)
                            countdown = rng.randint(1, 6)
                            if pending is None:
                                continue
                            tally.faults[pending.kind] += 1
                            done = sum(tally.faults.values())
                            if done % 100 == 0:  # a long run shows it moves (stderr)
                                print(f"... {done} faults, {tally.epochs} epochs, "
                                      f"{time.monotonic() - started:.0f} s", file=sys.stderr,
                                      flush=True)
                            if pending.kind == "MemoryError":
                                expect_errors += 1
                            if pending.kind in SIGNALS and pending.wid is None:
                                tally.aside[pending.kind] += 1
                            if pending.kind in ("transient", "MemoryError") or (
                                    pending.kind in SIGNALS and pending.wid is None):
                                pending = None  # nothing to recover from (a standby hit)
                    if seen == EXPECTED:
                        tally.exact += 1
                    else:
                        tally.bad.append(f"epoch {tally.epochs}: {len(seen)} batches, "
                                         f"first wrong at {_first_wrong(seen)}")
                except aioloader.WorkerError as exc:
                    # a load's error comes as LoadError, naming the original
                    if expect_errors and "MemoryError" in str(exc) and _prefix_ok(seen):
                        tally.raised_as_expected += 1
                        expect_errors -= 1
                        if pending is not None and pending.kind == "MemoryError":
                            pending = None
                        _taken_by(box, "MemoryError")
                    else:
                        tally.bad.append(f"epoch {tally.epochs}: {type(exc).__name__}: "
                                         f"{str(exc).splitlines()[0]}")
                        if len(tally.bad) > 20:
                            break
                except aioloader.LoaderTimeoutError as exc:
                    tally.bad.append(f"epoch {tally.epochs}: {exc}")
                    if len(tally.bad) > 20:
                        break
            st = loader.stats()
            tally.stats = {"restarts": st.restarts, "crashes": st.crashes, "hangs": st.hangs}
            if pending is not None:
                tally.unrecovered[pending.kind] += 1
            tally.untaken = len(os.listdir(box)) - 1
        finally:
            await loader.aclose()
            logging.getLogger("aioloader").removeHandler(hang_log)
    tally.seconds = time.monotonic() - started
    tally.leftovers = _leftovers(shm_before)
    tally.stopped = injector.stopped
    tally.hung = hang_log.hung
    tally.load = (load_before, os.getloadavg()[0])
    return tally


def _first_wrong(seen: list[list[int]]) -> int:
    for k, (a, b) in enumerate(zip(seen, EXPECTED, strict=False)):
        if a != b:
            return k
    return min(len(seen), len(EXPECTED))


def _prefix_ok(seen: list[list[int]]) -> bool:
    """What an epoch that raised handed over before it raised: the first batches, once."""
    return seen == EXPECTED[:len(seen)]


def _leftovers(shm_before: set[str], grace: float = 10.0) -> list[str]:
    """Children (not multiprocessing's helpers) and new /dev/shm entries still there after
    ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while True:
        kids = _children()
        shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
        if not (kids or shm) or time.monotonic() > deadline:
            return [f"pid {p}" for p in kids] + [f"/dev/shm/{s}" for s in shm]
        time.sleep(0.1)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def report_faults(t: Tally) -> bool:
    false_hangs = [h for h in t.hung if not h.isdigit() or int(h) not in t.stopped]
    ok = not t.bad and not t.leftovers and not false_hangs and not +t.unrecovered
    print(f"== faults, start_method={t.method}, timeout={t.timeout:g} s, {WORKERS} workers, "
          f"{N // BATCH} batches an epoch: {sum(t.faults.values())} injected in "
          f"{t.seconds:.0f} s over {t.epochs} epochs (load average {t.load[0]:.1f} -> "
          f"{t.load[1]:.1f} on {os.cpu_count()} CPUs)")
    for kind, n in sorted(t.faults.items()):
        rec = t.recovery.get(kind, [])
        times = (f"recovery p50 {_pct(rec, 50) * 1e3:.0f} ms, p99 {_pct(rec, 99) * 1e3:.0f} ms, "
                 f"max {max(rec) * 1e3:.0f} ms over {len(rec)}" if rec else
                 "no recovery to time (a standby hit, an error raised, or a retry)")
        aside = f" ({t.aside[kind]} into a standby or successor)" if t.aside[kind] else ""
        if t.renewed[kind]:
            aside += (f" ({t.renewed[kind]} in an epoch that then failed (an injected MemoryError, "
                      "a timeout): replaced with the rest, not restarted, not timed)")
        print(f"   {kind:12s} {n:5d}   {times}{aside}")
    for fault, times in sorted(t.restarting.items()):
        print(f"   fault to the loader's restart of that worker (its warning), {fault}: p50 "
              f"{_pct(times, 50) * 1e3:.0f} ms, p99 {_pct(times, 99) * 1e3:.0f} ms over "
              f"{len(times)}")
    absorbed = t.faults["MemoryError"] - t.raised_as_expected - t.untaken
    if absorbed > 0:
        print(f"   MemoryErrors not raised: {absorbed} (the worker that had failed that "
              "batch was killed before the consumer reached it; its replacement built the "
              "batch again, without the error: the ticket is used once)")
    print(f"   loader.stats(): restarts {t.stats.get('restarts')} (crashes "
          f"{t.stats.get('crashes')}, hangs {t.stats.get('hangs')})")
    print(f"   killed as hung by the loader: {len(t.hung)}, of which stopped by this script: "
          f"{len(t.hung) - len(false_hangs)}; slow (not stopped) workers taken for hung: "
          f"{len(false_hangs)}{' ' + str(false_hangs[:10]) if false_hangs else ''}")
    unrecovered = ", ".join(f"{k} {n}" for k, n in sorted(t.unrecovered.items()))
    print(f"   faults with no replacement batch seen: {unrecovered or 'none'}; fault "
          f"tickets no worker took: {t.untaken}")
    print(f"   epochs exact and in order: {t.exact} of {t.epochs}; raised MemoryError as "
          f"WorkerError with every earlier batch once: {t.raised_as_expected}")
    for line in t.bad[:10]:
        print(f"   BAD {line}")
    print(f"   leftovers: {', '.join(t.leftovers) or 'none'}")
    print(f"   verdict: {'exactly once, in order, nothing left' if ok else 'FAILED'}")
    return ok


# ------------------------------------------------------------------ the parent killed

VICTIM = """
import json, os, sys, aioloader
from aioloader.testing import descendants
sys.path.insert(0, {here!r})
from chaos import Keys
loader = aioloader.DataLoader(Keys(), batch_size=4, num_workers=2, start_method={method!r},
                              persistent_workers=True, quiet=True)
while True:
    for batch in loader:
        print(json.dumps(descendants()), flush=True)
"""


def parent_kills(method: str, kills: int, rng: random.Random) -> dict[str, Any]:
    """``kills`` training processes killed with SIGKILL once their workers ran; what
    survived ORPHAN_GRACE + MARGIN."""
    survivors: list[str] = []
    gone_after: list[float] = []
    shm_before = set(os.listdir("/dev/shm"))
    code = VICTIM.format(here=str(Path(__file__).parent), method=method)
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert proc.stdout is not None
        for _ in range(rng.randint(1, 20)):  # batches: a random moment mid-epoch
            if not proc.stdout.readline():
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        left = members(session=proc.pid)
        while left and time.monotonic() - killed < ORPHAN_GRACE + MARGIN:
            time.sleep(0.02)
            left = members(session=proc.pid)
        gone_after.append(time.monotonic() - killed)
        if left:
            survivors += [f"pid {p}" for p in left]
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        proc.stdout.close()
    shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
    return {"method": method, "kills": kills, "survivors": survivors, "shm": shm,
            "gone_p50": statistics.median(gone_after), "gone_max": max(gone_after)}


def report_parent(r: dict[str, Any]) -> bool:
    ok = not r["survivors"] and not r["shm"]
    print(f"== parent killed (SIGKILL), start_method={r['method']}: {r['kills']} times; every "
          f"descendant gone within p50 {r['gone_p50']:.2f} s, max {r['gone_max']:.2f} s "
          f"(ORPHAN_GRACE {ORPHAN_GRACE:g} s + {MARGIN:g} s allowed)")
    print(f"   survivors: {', '.join(r['survivors']) or 'none'}; /dev/shm entries left: "
          f"{', '.join(r['shm']) or 'none'}")
    print(f"   verdict: {'nothing survived' if ok else 'FAILED'}")
    return ok


# ------------------------------------------------------------------ the command

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("faults", help="inject faults into live workers while epochs run")
    f.add_argument("--crashes", type=int, default=1000, help="SIGKILL, SIGSEGV, os._exit(0)")
    f.add_argument("--hangs", type=int, default=200, help="SIGSTOP (not with --ray)")
    f.add_argument("--errors", type=int, default=20,
                   help="each of MemoryError and transient errors from the load function")
    f.add_argument("--timeout", type=float, default=2.0,
                   help="the loader's timeout: a silent worker's hang is healed after it")
    f.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop injecting after this long per start method; says how many")
    f.add_argument("--ray", action="store_true", help="also on Ray actors (a local Ray)")
    p = sub.add_parser("parent", help="kill the training process with SIGKILL, N times")
    p.add_argument("--kills", type=int, default=100)
    for q in (f, p):
        q.add_argument("--methods", default="fork,spawn,forkserver")
        q.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ok = True
    if args.mode == "parent":
        rng = random.Random(args.seed)
        for method in methods:
            ok &= report_parent(parent_kills(method, args.kills, rng))
        return 0 if ok else 1
    runs = [(m, False) for m in methods] + ([("fork", True)] if args.ray else [])
    for method, ray in runs:
        if ray:
            import ray as ray_module

            ray_module.init(num_cpus=WORKERS + 1, include_dashboard=False, log_to_driver=False)
        try:
            tally = asyncio.run(run_faults(method, args.crashes, args.hangs, args.errors,
                                           args.timeout, ray, args.seed, args.max_seconds))
        finally:
            if ray:
                ray_module.shutdown()
        ok &= report_faults(tally)
        print(json.dumps({"method": tally.method, "faults": dict(tally.faults),
                          "epochs": tally.epochs, "exact": tally.exact, "bad": len(tally.bad)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
