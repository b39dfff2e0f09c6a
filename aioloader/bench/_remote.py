"""The remote workload: objects fetched over HTTP with latency, by aioloader, torch and SPDL.

One local object server (``aioloader.testing.object_server``: ``count`` objects of ``size``
bytes, every request answered after ``latency`` seconds) serves every run. Each run, in a
fresh forked process, reads the first objects of the store, decodes each to a uint8 tensor
(``torch.frombuffer``) and batches them by 16:

* ``aioloader c=C``: ``DataLoader(FsspecReader(urls), num_workers=W, concurrency=C)``, so
  ``W x C`` requests in flight;
* ``torch``: ``torch.utils.data.DataLoader`` over a map-style dataset whose ``__getitem__``
  GETs its URL with a keep-alive ``http.client`` connection per worker: ``W`` in flight;
* ``spdl k=K``: an ``spdl.pipeline`` whose async fetch stage (an aiohttp session) runs with
  ``concurrency=K``, then ``aggregate(16)`` and a collate stage, in this one process. It is
  run at ``K = C`` (the same per event loop) and ``K = W x C`` (the same in flight in all:
  the fair comparison, since the latency hidden is what is in flight);
* ``ceiling``: a plain aiohttp client, ``CEILING_INFLIGHT`` requests in flight, no decode:
  what the server itself can serve on this machine.

A run reads ``PER_INFLIGHT`` objects per request it keeps in flight (up to the store), so a
slow configuration takes seconds, not minutes. Rates are timed from the first batch to the
last; the server's CPU share and the machine's over the same window say who was busy. Memory
is the peak growth, sampled every ``_footprint.SAMPLE_S``, of the private anonymous pages of the
consumer and its workers (summed) plus their shared-memory pages (the arena, counted once).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import importlib
import os
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

import aioloader
from aioloader.readers import FsspecReader
from aioloader.testing import ObjectServer, object_server

from ._footprint import Busy, Footprint
from ._measure import Clock, Face, LoopName, run_on
from ._peers import Setup, torch_loader
from ._report import QUICK_NOTE, targets_header, verdict
from ._runner import MeasurementError, isolated_call

Result = dict[str, Any]
REMOTE = "remote"  # the workload's name on the command line
COUNT, QUICK_COUNT = 4000, 200
SIZE = 100_000  # bytes per object
LATENCY = 0.020  # seconds the server waits before each answer
BATCH_SIZE = 16
DEFAULT_CONCURRENCY = (1, 8, 32, 128)
QUICK_CONCURRENCY = (1, 8)
PER_INFLIGHT = 400  # objects a run reads per request in flight (so ~8 s at 20 ms each)
CEILING_INFLIGHT = 256
TORCH_RATIO_TARGET = (32, 15.0)  # issue 11: at c=32, at least 15x torch


@dataclass(frozen=True)
class RemotePlan:
    """The options of one remote measurement series."""

    count: int = COUNT
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    num_workers: int = 2
    start_method: str = "fork"
    pairs: int = 3
    face: Face = "async"
    loop: LoopName = "asyncio"
    timeout: float = 300.0
    size: int = SIZE
    latency: float = LATENCY

    @property
    def workers(self) -> int:
        """Processes that fetch on aioloader's and torch's side (the consumer when 0)."""
        return max(1, self.num_workers)

    def objects(self, inflight: int) -> int:
        """Objects a run with ``inflight`` requests in flight reads: whole batches per worker."""
        unit = BATCH_SIZE * self.workers
        return max(unit, min(self.count, PER_INFLIGHT * inflight) // unit * unit)


@dataclass(frozen=True)
class Run:
    """One configuration: ``side`` is aioloader, torch, spdl or ceiling; ``concurrency`` is
    the loader's (aioloader: per worker; spdl: of its fetch stage)."""

    side: str
    concurrency: int = 0

    @property
    def name(self) -> str:
        if self.side == "aioloader":
            return f"aioloader c={self.concurrency}"
        if self.side == "spdl":
            return f"spdl k={self.concurrency}"
        return self.side

    def inflight(self, plan: RemotePlan) -> int:
        if self.side == "aioloader":
            return plan.workers * self.concurrency
        if self.side == "torch":
            return plan.workers
        if self.side == "ceiling":
            return CEILING_INFLIGHT
        return self.concurrency


def spdl_missing() -> str | None:
    """Why SPDL's side cannot run here, or None."""
    try:
        importlib.import_module("spdl.pipeline")
    except ImportError as exc:
        return f"spdl is not installed ({exc}); its rows are left out"
    return None


def runs_of(plan: RemotePlan, with_spdl: bool) -> list[Run]:
    """Every configuration of one pair, in order."""
    runs = [Run("ceiling"), Run("torch")]
    for c in plan.concurrency:
        runs.append(Run("aioloader", c))
        if with_spdl:
            runs.extend(Run("spdl", k) for k in sorted({c, plan.workers * c}))
    return list(dict.fromkeys(runs))  # spdl k=8 may come from c=8 and from c=4 x 2


# ------------------------------------------------------------------------- the decode

def to_tensor(url: str, data: bytes) -> torch.Tensor:
    """The same decode on every side: the object's bytes as a uint8 tensor (one copy)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ---------------------------------------------------------------------- the aioloader side

def lazy_block(c: int) -> int:
    """``max_instances_in_memory`` for concurrency ``c``: whole batches, at least ``c``."""
    return -(-c // BATCH_SIZE) * BATCH_SIZE


def _aioloader(plan: RemotePlan, urls: list[str], c: int) -> aioloader.DataLoader[Any]:
    # Lazy: the default (cached) mode keeps every instance of the first epoch in the main
    # process, which for an object store is the whole bucket.
    return aioloader.DataLoader(FsspecReader(urls, decode=to_tensor), batch_size=BATCH_SIZE,
                                num_workers=plan.num_workers, start_method=plan.start_method,
                                concurrency=c, max_instances_in_memory=lazy_block(c),
                                quiet=True)


# -------------------------------------------------------------------------- the torch side

class HttpObjects(Dataset[Any]):
    """A map-style dataset of URLs: ``__getitem__`` GETs one, blocking, over a keep-alive
    connection that each process opens for itself."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> torch.Tensor:
        url = urllib.parse.urlsplit(self.urls[index])
        key = (os.getpid(), url.netloc)
        conn = _CONNECTIONS.get(key)
        if conn is None:
            conn = _CONNECTIONS[key] = http.client.HTTPConnection(url.netloc, timeout=60)
        conn.request("GET", url.path)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise OSError(f"GET {self.urls[index]}: HTTP {response.status}")
        return to_tensor(self.urls[index], data)


_CONNECTIONS: dict[tuple[int, str], http.client.HTTPConnection] = {}


# --------------------------------------------------------------------------- the SPDL side

class AiohttpFetch:
    """SPDL's async fetch stage: ``await fetch(url)`` -> decoded tensor, over one session.

    The session opens on the pipeline's event loop at the first call; the last of ``total``
    fetches closes it there (SPDL 0.8 gives an op no hook of its own to close a resource).
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.session: Any = None

    async def __call__(self, url: str) -> torch.Tensor:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self.session.get(url) as response:
            response.raise_for_status()
            data = await response.read()
        self.done += 1
        if self.done == self.total:
            await self.session.close()
        return to_tensor(url, data)


def _spdl_batches(urls: list[str], concurrency: int) -> Iterator[Any]:
    builder = importlib.import_module("spdl.pipeline").PipelineBuilder
    pipeline = (builder()
                .add_source(urls)
                .pipe(AiohttpFetch(len(urls)), concurrency=concurrency)
                .aggregate(BATCH_SIZE)
                .pipe(default_collate)
                .add_sink()
                .build(num_threads=2))
    with pipeline.auto_stop():
        yield from pipeline.get_iterator()


# ------------------------------------------------------------------------ the ceiling

async def _ceiling(urls: list[str], inflight: int) -> tuple[float, int]:
    """Seconds to GET every URL, ``inflight`` at a time, and the bytes read."""
    import aiohttp

    gate = asyncio.Semaphore(inflight)
    nbytes = 0

    async def get(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal nbytes
        async with gate, session.get(url) as response:
            response.raise_for_status()
            data = await response.read()
            nbytes += len(data)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await get(session, urls[0])  # connect once outside the timing
        t0 = time.perf_counter()
        await asyncio.gather(*(get(session, url) for url in urls))
        return time.perf_counter() - t0, nbytes


# ------------------------------------------------------------------- one run, in a child

def measure_run(run: Run, plan: RemotePlan, server: ObjectServer) -> Result:
    """``run`` here: its rate, the CPU shares over the timed window, and its memory growth."""
    n = plan.count if run.side == "ceiling" else plan.objects(run.inflight(plan))
    urls = [server.object_url(name) for name in server.names[:min(n, len(server.names))]]
    busy = Busy(server.pid)
    # Imported here, before any worker forks and before the memory is sampled, on every side
    for module in ("aiohttp", "fsspec.implementations.http", "spdl.pipeline"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    gc.collect()
    footprint = Footprint()
    out: Result = {"objects": len(urls)}
    if run.side == "ceiling":
        busy.mark()
        seconds, nbytes = asyncio.run(_ceiling(urls, CEILING_INFLIGHT))
        busy.mark()
        figures: Result = {"objects_per_s": len(urls) / seconds, "mb_per_s": nbytes / seconds / 1e6}
    else:
        clock = Clock()
        if run.side == "aioloader":
            out.update(_consume_aioloader(plan, urls, run.concurrency, clock, busy))
        elif run.side == "torch":
            loader = torch_loader(HttpObjects(urls), Setup(BATCH_SIZE, plan.num_workers,
                                                           plan.start_method, None))
            _consume(loader, clock, busy)
            del loader
            gc.collect()  # torch's workers stop with the loader's last reference
        else:
            _consume(_spdl_batches(urls, run.concurrency), clock, busy)
        clock_figures = clock.figures()
        figures = {"objects_per_s": clock_figures["mb_per_s"] * 1e6 / plan.size,
                   "mb_per_s": clock_figures["mb_per_s"],
                   "ttfb_ms": clock_figures["ttfb_ms"]}
        if "data_stall_pct" in clock_figures:
            figures["data_stall_pct"] = clock_figures["data_stall_pct"]
    return {**out, **figures, **busy.figures(), "peak_mb": footprint.growth_mb()}


def _consume(batches: Iterable[Any], clock: Clock, busy: Busy) -> None:
    for batch in batches:
        clock.arrived(batch)
        if len(clock.stamps) == 1:
            busy.mark()
    busy.mark()


def _consume_aioloader(plan: RemotePlan, urls: list[str], c: int, clock: Clock,
                       busy: Busy) -> Result:
    def stats(loader: aioloader.DataLoader[Any]) -> Result:
        s = loader.stats()
        clock.data_stall = s.data_stall
        return {"arena_bytes": s.arena.bytes}

    if plan.face == "sync":
        with _aioloader(plan, urls, c) as loader:
            _consume(loader, clock, busy)
            return stats(loader)

    async def epoch() -> Result:
        async with _aioloader(plan, urls, c) as loader:
            async for batch in loader:
                clock.arrived(batch)
                if len(clock.stamps) == 1:
                    busy.mark()
            busy.mark()
            return stats(loader)

    return run_on(plan.loop, epoch())


# ------------------------------------------------------------------------------ the series

def run_remote(plan: RemotePlan, with_spdl: bool,
               note: Callable[[str], None] = lambda _: None) -> Result:
    """Start the server, then ``plan.pairs`` rounds over every configuration, alternating."""
    runs = runs_of(plan, with_spdl)
    results: dict[str, list[Result]] = {run.name: [] for run in runs}
    with object_server(count=plan.count, size=plan.size, latency=plan.latency) as server:
        for pair in range(plan.pairs):
            for run in runs if pair % 2 == 0 else reversed(runs):
                result = isolated_call(measure_run, (run, plan, server), plan.timeout,
                                       f"{REMOTE} / {run.name}")
                results[run.name].append(result)
            note(f"{REMOTE}: round {pair + 1} of {plan.pairs} done")
    return {"runs": results,
            "order": [{"name": r.name, "side": r.side, "concurrency": r.concurrency,
                       "inflight": r.inflight(plan)} for r in runs]}


# ---------------------------------------------------------------------------------- report

def summary_rows(plan: RemotePlan, raw: Result) -> list[Result]:
    """Per configuration: medians over pairs, and aioloader's per-pair ratios' medians."""
    runs: dict[str, list[Result]] = raw["runs"]
    rows = []
    for entry in raw["order"]:
        results = runs[entry["name"]]
        row: Result = dict(entry)
        for key in ("objects", "objects_per_s", "mb_per_s", "server_cores", "client_cores",
                    "machine_cores", "data_stall_pct"):
            values = [r[key] for r in results if key in r]
            if values:
                row[key] = statistics.median(values)
        row["peak_mb"] = max(r["peak_mb"] for r in results)
        if entry["side"] == "aioloader":
            c = entry["concurrency"]
            arena = max(r["arena_bytes"] for r in results)
            row["arena_mb"] = arena / 1e6
            row["bound_mb"] = (plan.workers * c * plan.size + arena) / 1e6
            for peer, key in (("torch", "x_torch"), (f"spdl k={c}", "x_spdl_c"),
                              (f"spdl k={plan.workers * c}", "x_spdl_equal")):
                if peer in runs:
                    row[key] = statistics.median(
                        a["objects_per_s"] / b["objects_per_s"]
                        for a, b in zip(results, runs[peer], strict=True))
        rows.append(row)
    return rows


_COLUMNS = (  # heading, key, format
    ("config", "name", "s"), ("in flight", "inflight", "d"), ("objects", "objects", ".0f"),
    ("obj/s", "objects_per_s", ".0f"), ("MB/s", "mb_per_s", ".1f"),
    ("x torch", "x_torch", ".1f"), ("x spdl k=c", "x_spdl_c", ".2f"),
    ("x spdl k=Wc", "x_spdl_equal", ".2f"), ("server", "server_cores", ".2f"),
    ("client", "client_cores", ".2f"), ("machine", "machine_cores", ".2f"),
    ("peak MB", "peak_mb", ".1f"), ("bound MB", "bound_mb", ".1f"),
)


def table(plan: RemotePlan, rows: Sequence[Result]) -> str:
    """The remote table, plain text: the configuration left-aligned, the figures right."""
    head = tuple(h for h, _, _ in _COLUMNS)
    cells = [tuple(format(row[k], f) if row.get(k) is not None else "-"
                   for _, k, f in _COLUMNS) for row in rows]
    first, *rest = [max(map(len, column)) for column in zip(head, *cells, strict=True)]
    grid = ["  ".join([c[0].ljust(first), *map(str.rjust, c[1:], rest)]) for c in (head, *cells)]
    caption = (f"remote: {plan.count} objects of {plan.size // 1000} KB, "
               f"{plan.latency * 1e3:.0f} ms per request, batch {BATCH_SIZE}, "
               f"num_workers={plan.num_workers}, face={plan.face}; medians of {plan.pairs} "
               "(each in a fresh process); server, client (consumer + workers), machine: CPU "
               f"cores busy over the timed window (of {os.cpu_count()}); peak MB: growth of "
               "consumer + workers; bound: W x c x object size + arena")
    return "\n".join([caption, *grid])


def target_lines(plan: RemotePlan, rows: Sequence[Result], *, judged: bool = True) -> list[str]:
    """Issue 11's targets, met or missed (``judged=False``, ``--quick``: ``n/a``), and what
    bounds the rates."""
    lines = []
    aio = {r["concurrency"]: r for r in rows if r["side"] == "aioloader"}
    at, want = TORCH_RATIO_TARGET
    words = ("met", "MISSED")
    if at in aio and "x_torch" in aio[at]:
        got = aio[at]["x_torch"]
        lines.append(f"  aioloader c={at} >= {want:.0f}x torch: {got:.1f}x "
                     f"{verdict(got >= want, judged, words)}")
    for c, row in aio.items():
        if "x_spdl_equal" in row:
            got = row["x_spdl_equal"]
            lines.append(f"  aioloader c={c} >= spdl at the same in flight "
                         f"(k={plan.workers * c}): {got:.2f}x "
                         f"{verdict(got >= 1, judged, words)}")
    for c, row in aio.items():
        ok = row["peak_mb"] <= row["bound_mb"]
        lines.append(f"  aioloader c={c} memory: peak growth {row['peak_mb']:.1f} MB <= bound "
                     f"{row['bound_mb']:.1f} MB (arena {row['arena_mb']:.1f} MB): "
                     f"{verdict(ok, judged, words)} "
                     f"({row['peak_mb'] - row['bound_mb']:+.1f} MB)")
    ceiling = next((r for r in rows if r["side"] == "ceiling"), None)
    if ceiling is not None and aio:
        best = max(aio.values(), key=lambda r: r["objects_per_s"])
        lines.append(f"  server ceiling (plain aiohttp, {CEILING_INFLIGHT} in flight): "
                     f"{ceiling['objects_per_s']:.0f} obj/s with the server on "
                     f"{ceiling['server_cores']:.2f} cores, the machine on "
                     f"{ceiling['machine_cores']:.2f}; best aioloader "
                     f"(c={best['concurrency']}) reaches "
                     f"{best['objects_per_s'] / ceiling['objects_per_s']:.0%} of it")
    return lines


def concurrency_list(text: str) -> tuple[int, ...]:
    """``--concurrency 1,8,32``: positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers like 1,8,32,128, got {text!r}")
    return values


def run_cli(args: Any, pairs: int) -> tuple[Result, bool]:
    """``--workloads remote`` from the command line: prints its table; (JSON section, failed)."""
    quick = bool(args.quick)
    plan = RemotePlan(count=QUICK_COUNT if quick else COUNT,
                      concurrency=args.concurrency or (
                          QUICK_CONCURRENCY if quick else DEFAULT_CONCURRENCY),
                      num_workers=args.num_workers, start_method=args.start_method,
                      pairs=pairs, face=args.face, loop=args.loop, timeout=float(args.timeout))
    missing = spdl_missing()
    if missing is not None:
        print(f"\nnote: {missing}", flush=True)
    t0 = time.monotonic()
    config = {"count": plan.count, "size": plan.size, "latency": plan.latency,
              "batch_size": BATCH_SIZE, "concurrency": list(plan.concurrency),
              "pairs": plan.pairs, "face": plan.face, "spdl": missing is None}
    try:
        raw = run_remote(plan, missing is None, note=lambda line: print(
            f"  ({line})", file=sys.stderr, flush=True))
    except MeasurementError as exc:
        print(f"aioloader bench: {REMOTE}: {exc}", file=sys.stderr)
        return {"config": config, "error": str(exc)}, True
    rows = summary_rows(plan, raw)
    print()
    print(table(plan, rows))
    print()
    print(targets_header(QUICK_NOTE if quick else "medians over pairs"))
    print("\n".join(target_lines(plan, rows, judged=not quick)))
    for name, results in raw["runs"].items():
        left = [pid for r in results for pid in r.get("leftover_pids", ())]
        if left:
            print(f"aioloader bench: warning: {REMOTE}/{name} left processes {left} behind; "
                  "killed them", file=sys.stderr)
    print(f"  ({REMOTE}: {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    return {"config": config, **raw, "summary": rows}, False
