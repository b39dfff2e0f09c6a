"""GPU check of the sync adapter's CUDA path (issue 13): speed, bytes, pinned memory, overlap.

Run ``python scripts/gpu_check.py`` on a machine with a CUDA GPU (under 3 minutes on one
H200 with 16 cores). Image batches (uint8 [64, 3, 224, 224], a new tensor per sample,
2 workers, fork) go through ``loader.sync(device="cuda:0")`` and through torch's DataLoader
with ``pin_memory=True`` + ``.to("cuda", non_blocking=True)``:

a. H2D GB/s and batches/s of both, 3 alternating repetitions;
b. every batch the consumer gets equals the CPU batch (checksums against a CPU run);
c. no pinned allocation per batch (torch's host allocator stats and the ring's counter);
d. overlap: a profiler trace (chrome JSON in $OUT, else /tmp) with a model step per batch;
   HtoD copies must run on a stream of their own and overlap compute kernels.

Prints a compact report; exits 1 if a check failed. Without CUDA it says "no CUDA" and
exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

BATCH, SHAPE, WORKERS = 64, (3, 224, 224), 2
TIMED_BATCHES, WARM_BATCHES, REPS = 120, 8, 3
PROFILED_BATCHES = 24
STEP_MS = 15.0  # the model step: longer than the loader needs for a batch, so the CPU runs ahead


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A new uint8 image tensor per sample (a clone of one of a few random ones)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, 256, (16, *SHAPE), dtype=torch.uint8, generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.pool[(i * 7) % len(self.pool)].clone()
        image[0, 0, 0] = i % 256  # no two neighbours alike
        return image, i


def ours(n: int) -> Any:
    import aioloader

    return aioloader.DataLoader(Images(n), batch_size=BATCH, num_workers=WORKERS,
                                start_method="fork", quiet=True, seed=0)


def theirs(n: int) -> Any:
    return torch.utils.data.DataLoader(Images(n), batch_size=BATCH, num_workers=WORKERS,
                                       multiprocessing_context="fork", pin_memory=True)


def checksum(images: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """Position-weighted, exact in int64 on any device."""
    flat = images.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 251 + 1
    return int((flat * weights).sum()), int((labels.to(torch.int64) * 31).sum())


# ------------------------------------------------------------------ a: speed

def timed(batches: Iterable[Any], to_device: Callable[[Any], Any]) -> tuple[float, float]:
    """(GB/s, batches/s) past the first WARM_BATCHES, the GPU synchronized at both ends."""
    nbytes, count, start = 0, 0, 0.0
    for k, batch in enumerate(batches):
        images, labels = to_device(batch)
        if k == WARM_BATCHES - 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        elif k >= WARM_BATCHES:
            nbytes += images.numel() + labels.numel() * labels.element_size()
            count += 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9, count / seconds


def speed(report: Report) -> None:
    n = (TIMED_BATCHES + WARM_BATCHES) * BATCH
    results: dict[str, list[tuple[float, float]]] = {"aioloader": [], "torch": []}
    with ours(n) as loader:
        for _ in range(REPS):
            results["aioloader"].append(timed(loader.sync(device="cuda:0"), lambda b: b))
            results["torch"].append(timed(theirs(n), lambda b: [
                t.to("cuda:0", non_blocking=True) for t in b]))
    for name, runs in results.items():
        best = max(runs)
        report.line(f"a {name:9s} H2D {best[0]:6.2f} GB/s {best[1]:7.1f} batches/s  (runs: "
                    + ", ".join(f"{gbs:.2f}" for gbs, _ in runs) + ")")
    ratio = max(results["aioloader"])[1] / max(results["torch"])[1]
    report.line(f"a aioloader / torch batches/s: {ratio:.2f}x (a measure, not a check)")


# ------------------------------------------------------------------ b, c: bytes and memory

def host_allocs() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    return int(stats().get("num_host_alloc", 0))


def correct_and_no_pinned_growth(report: Report) -> None:
    from aioloader.plane import _staging

    n = 40 * BATCH
    with ours(n) as loader:
        want = [checksum(*b) for b in loader.sync()]
        it = iter(loader.sync(device="cuda:0"))
        first = [next(it) for _ in range(4)]  # warm-up: the ring is allocated
        torch.cuda.synchronize()
        ring, host = _staging.ring_allocations(), host_allocs()
        rest = list(it)
        torch.cuda.synchronize()
        ring_after, host_after = _staging.ring_allocations(), host_allocs()
        # A second epoch: a new ring, whose buffers torch's caching host allocator reuses.
        again = [checksum(*b) for b in loader.sync(device="cuda:0")]
        host_again = host_allocs()
    got = [checksum(*b) for b in first + rest]
    devices = {b[0].device.type for b in first + rest}
    report.check("b batches on cuda, equal to the CPU run", got == want and devices == {"cuda"},
                 f"{sum(g == w for g, w in zip(got, want, strict=False))}/{len(want)} equal")
    report.check("b second epoch equal too", again == want)
    report.check("c no ring allocation after warm-up", ring_after == ring,
                 f"ring buffers {ring} -> {ring_after} over {len(rest)} batches")
    if host is None or host_after is None:
        report.line("c torch.cuda.host_memory_stats missing: host check skipped")
    else:
        report.check("c no new cudaHostAlloc per batch", host_after == host,
                     f"num_host_alloc {host} -> {host_after} over {len(rest)} batches")
        report.check("c none for the next epoch's ring either", host_again == host_after,
                     f"num_host_alloc {host_after} -> {host_again}")


# ------------------------------------------------------------------ d: overlap

@dataclasses.dataclass
class Overlap:
    copy_streams: set[int]
    compute_streams: set[int]
    copies: int
    pageable: int  # HtoD copies from pageable memory (synchronous): should be none
    fraction: float  # of HtoD time spent while a compute kernel ran


def overlap(path: pathlib.Path) -> Overlap:
    """HtoD copies against compute kernels, from a chrome trace of torch.profiler."""
    events = json.loads(path.read_text())["traceEvents"]
    copies, kernels = [], []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        stream = ev.get("args", {}).get("stream")
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), stream)
        if ev.get("cat") == "gpu_memcpy" and "HtoD" in ev.get("name", ""):
            copies.append((span, "Pageable" in ev["name"]))
        elif ev.get("cat") == "kernel":
            kernels.append(span)
    kernels.sort()
    total = covered = 0.0
    for (lo, hi, _), _pageable in copies:
        total += hi - lo
        for klo, khi, _ in kernels:
            if klo >= hi:
                break
            covered += max(0.0, min(hi, khi) - max(lo, klo))
    return Overlap(copy_streams={s for (_, _, s), _ in copies},
                   compute_streams={s for _, _, s in kernels}, copies=len(copies),
                   pageable=sum(p for _, p in copies),
                   fraction=covered / total if total else 0.0)


def model_step() -> Callable[[torch.Tensor], torch.Tensor]:
    """A step of about STEP_MS on the GPU that reads the batch: matmuls, repeated."""
    w = torch.randn(4096, 4096, device="cuda:0", dtype=torch.bfloat16) / 64
    h0 = torch.randn(4096, 4096, device="cuda:0", dtype=torch.bfloat16)

    def step(images: torch.Tensor, reps: int) -> torch.Tensor:
        h = h0 * images[:, :, :8, :8].float().mean().to(torch.bfloat16)
        for _ in range(reps):
            h = torch.tanh(h @ w)
        return h.sum()

    step(torch.zeros(1, 3, 8, 8, dtype=torch.uint8, device="cuda:0"), 2)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    step(torch.zeros(1, 3, 8, 8, dtype=torch.uint8, device="cuda:0"), 20)
    end.record()
    end.synchronize()
    reps = max(1, round(STEP_MS / (start.elapsed_time(end) / 20)))
    return lambda images: step(images, reps)


def profiled_overlap(report: Report) -> None:
    from torch.profiler import ProfilerActivity, profile

    out = pathlib.Path(os.environ.get("OUT") or "/tmp")
    path = out / "aioloader_gpu_trace.json"
    step = model_step()
    with ours(PROFILED_BATCHES * BATCH) as loader:
        list(loader.sync())  # workers up before the trace
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for images, _ in loader.sync(device="cuda:0"):
                step(images)
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    found = overlap(path)
    report.line(f"d trace {path}: {found.copies} HtoD copies on streams "
                f"{sorted(found.copy_streams)}, compute on {sorted(found.compute_streams)}")
    report.check("d HtoD copies from pinned memory only", found.copies > 0
                 and found.pageable == 0, f"{found.pageable} pageable")
    report.check("d HtoD on a stream of its own",
                 bool(found.copy_streams) and not found.copy_streams & found.compute_streams)
    report.check("d HtoD overlaps compute", found.fraction > 0,
                 f"overlap fraction {found.fraction:.0%}")


# ------------------------------------------------------------------ report

class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def line(self, text: str) -> None:
        print(text, flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.line(f"{'ok  ' if ok else 'FAIL'} {name}" + (f"  [{detail}]" if detail else ""))
        if not ok:
            self.failed.append(name)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA: nothing to check here")
        return 0
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # a checkout
    report = Report()
    report.line(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                f"{os.cpu_count()} CPUs")
    began = time.perf_counter()
    for part in (correct_and_no_pinned_growth, profiled_overlap, speed):
        try:
            part(report)
        except Exception as exc:  # noqa: BLE001 - one failed part must not hide the others
            report.check(part.__name__, False, f"{type(exc).__name__}: {exc}")
    report.line(f"{len(report.failed)} failed, {time.perf_counter() - began:.0f} s")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
