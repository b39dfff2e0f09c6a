"""The consumer's own work between batches (``--step-ms``): a GIL-releasing torch op, so that
a loader that builds batches while the consumer works (the fetch thread ahead of ``async
for``; workers) shows it, as a training step on an accelerator would let it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.data import default_collate

from ._workloads import Workload

SIDE = 128  # the matmul's square side: 4.2 MFLOP, a fraction of a millisecond
FETCH = "fetch"  # --step-ms fetch: each workload's step is about its batch's fetch cost


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: the allocator, MKL, the OpenMP team
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul_ms(threads: int = 0) -> float:
    """One step matmul's time here, in ms, on ``threads`` intra-op threads (0: torch's)."""
    step = consumer_step(1, threads)
    return _median_ms(step, 50)


def fetch_ms(workload: Workload) -> float:
    """What building one of ``workload``'s batches costs in this process, as torch's
    ``num_workers=0`` builds it (``__getitem__`` then its collate), in ms."""
    dataset = workload.dataset(8 * workload.batch_size)
    collate = workload.torch_collate or default_collate
    batches = iter(range(1_000))

    def fetch() -> object:
        first = next(batches) % 8 * workload.batch_size
        return collate([dataset[i] for i in range(first, first + workload.batch_size)])

    return _median_ms(fetch, 7)


def reps_for(ms: float, one: float) -> int:
    """Matmuls of ``one`` ms each for a step of about ``ms``; none for ``ms <= 0``."""
    return 0 if ms <= 0 else max(1, round(ms / one))


def consumer_step(reps: int, threads: int = 0) -> Callable[[], None]:
    """The step a measurement runs after each batch: ``reps`` matmuls (nothing for 0), on
    ``threads`` of torch's intra-op threads (0: as many as torch has here, every core on a
    small machine, as a training step on the CPU takes them; 1: one core, as a step that an
    accelerator runs leaves the others to whoever wants them). The count is set for the
    step and put back after it, so that torch's ``num_workers=0`` fetches keep theirs."""
    if reps == 0:
        return lambda: None
    a = torch.randn(SIDE, SIDE)
    out = torch.empty(SIDE, SIDE)

    def step() -> None:
        for _ in range(reps):
            torch.mm(a, a, out=out)

    if threads <= 0:
        return step

    def on_threads() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            step()
        finally:
            torch.set_num_threads(before)

    return on_threads
