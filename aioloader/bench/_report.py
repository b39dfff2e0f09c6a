"""Summaries of the runs: medians, ratios over pairs, the table, what its figures mean, and
the targets."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ._measure import WAKES_PER_S, Result
from ._peers import PEERS
from ._runner import LAG_SIDES, LAGGED, LAGGED_SIDES, PROCESS, ZERO
from ._workloads import FIRST, LAG

THROUGHPUT_METRICS = (
    ("batches_per_s", "batches/s"),
    ("mb_per_s", "MB/s"),
    ("ttfb_ms", "first batch ms"),
    ("stall_ms", "epoch stall ms"),
    ("cpu_ms_per_batch", "main CPU ms/batch"),
    ("faults_per_batch", "main faults/batch"),
    ("peak_rss_mb", "peak RSS +MB"),
    # The consumer's wait share, from loader.stats() (aioloader only): see MEANINGS.
    ("data_stall_pct", "data stall %"),
)
# Each metric in a user's words, printed under the table for those in it: a reader of the
# output has the table and nothing else (issue 36).
MEANINGS = {
    "batches_per_s": "batches the consumer received per second (higher is better)",
    "mb_per_s": "the batches' bytes received per second (higher is better)",
    "ttfb_ms": "from DataLoader(...) to the first batch, the workers' start included",
    "stall_ms": "the wait between an epoch's last batch and the next epoch's first",
    "cpu_ms_per_batch": "CPU time of the consumer's process per batch: what loading takes "
                        "from the training loop's core",
    "faults_per_batch": "page faults of the consumer's process per batch: fresh memory touched",
    "peak_rss_mb": "how much the consumer's process grew, in MB",
    "data_stall_pct": "loader.stats().data_stall: the share of the time the consumer waited "
                      "for a batch (aioloader only). Without --step-ms this consumer does "
                      "nothing with its batches, so it is always waiting: near 100 % is "
                      "expected then and only says that the loader is what is measured. In a "
                      "training loop, under 5 % means the data keeps up",
    "lag_p50_ms": "how late a 1 ms timer on the consumer's event loop fired, median: what "
                  "loading blocks of the loop",
    "lag_p99_ms": "the same, 99th percentile",
    "lag_max_ms": "the same, worst",
    "start_lag_ms": "the timer's worst lateness before the first batch",
    "ray_ms_per_batch": "what a Ray worker costs per batch over a worker process",
    "construct_ms": "DataLoader(...) alone",
    "close_ms": "closing the loader, its workers reaped",
}
LEGEND_WIDTH = 100
RATIO_MEANING = ("ratio: aioloader / torch, median over pairs (min-max); above 1 is better "
                 "for batches/s and MB/s, below 1 for the others")
HIGHER_IS_BETTER = {"batches_per_s", "mb_per_s"}  # the others: lower is better
LAG_METRICS = (
    ("lag_p50_ms", "lag p50 ms"),
    ("lag_p99_ms", "lag p99 ms"),
    ("lag_max_ms", "lag max ms"),
    ("start_lag_ms", "start lag ms"),  # the worst tick before the first batch
    ("batches_per_s", "batches/s"),
)
FIRST_METRICS = (  # the first-batch workload's: all from DataLoader(...) on
    ("construct_ms", "construct ms"),
    ("ttfb_ms", "first batch ms"),
    ("close_ms", "close ms"),
)
LAG_P99 = "lag p99 ms [direct]"  # issue 13: at most 1 ms on every workload


@dataclass(frozen=True)
class Row:
    """One metric of one workload: medians of each side, and aioloader/torch over pairs.

    With ``--peers``, also each peer's median, and aioloader over the best of torch and the
    peers (by median) for this metric, over pairs.
    """

    workload: str
    metric: str
    label: str
    aioloader: float
    torch: float
    ratio: float
    ratio_min: float
    ratio_max: float
    against: str  # the side in the torch column
    peers: dict[str, float] = field(default_factory=dict)
    best_peer: str = ""  # "" when no peer ran or none has a figure
    best_ratio: float = math.nan

    def as_json(self) -> dict[str, Any]:
        return {k: _none_for_nan(v) for k, v in self.__dict__.items()}


def _none_for_nan(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _none_for_nan(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


@dataclass(frozen=True)
class Target:
    """One of the issues' targets: what was asked, what was measured, whether it holds."""

    name: str
    measured: str
    passed: bool


def _values(runs: Sequence[Result], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) is not None else math.nan for r in runs]


def median(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def _ratios(ours: Sequence[Result], theirs: Sequence[Result], metric: str) -> list[float]:
    """ours/theirs of each pair, where both have a figure."""
    pairs = zip(_values(ours, metric), _values(theirs, metric), strict=False)
    return [x / y for x, y in pairs if y > 0 and not math.isnan(x)]


def _row(workload: str, metric: str, label: str, ours: Sequence[Result],
         theirs: Sequence[Result], against: str,
         peers: Mapping[str, Sequence[Result]] | None = None) -> Row:
    kept = _ratios(ours, theirs, metric)
    row = Row(workload, metric, label, median(_values(ours, metric)),
              median(_values(theirs, metric)), median(kept), min(kept, default=math.nan),
              max(kept, default=math.nan), against)
    if not peers:
        return row
    medians = {side: median(_values(runs, metric)) for side, runs in peers.items()}
    rivals = {side: m for side, m in [(against, row.torch), *medians.items()]
              if not math.isnan(m)}
    if not rivals:
        return replace(row, peers=medians)
    pick = max if metric in HIGHER_IS_BETTER else min
    best = pick(rivals, key=rivals.__getitem__)
    best_runs = theirs if best == against else peers[best]
    return replace(row, peers=medians, best_peer=best,
                   best_ratio=median(_ratios(ours, best_runs, metric)))


def summarise(workload: str, runs: dict[str, list[Result]]) -> list[Row]:
    """The table rows of one workload."""
    if workload == LAG:
        ours = runs[LAG_SIDES[0]]
        return [_row(workload, metric, f"{label} [{side.removeprefix('torch-')}]", ours,
                     runs[side], side)
                for side in LAG_SIDES[1:] for metric, label in LAG_METRICS]
    peers = {side: runs[side] for side in PEERS if side in runs}
    metrics = FIRST_METRICS if workload == FIRST else THROUGHPUT_METRICS
    rows = [_row(workload, metric, label, runs["aioloader"], runs["torch"], "torch", peers)
            for metric, label in metrics]
    if ZERO in runs:
        rows.insert(1, _row(workload, "batches_per_s", "batches/s @0 workers", runs[ZERO], [],
                            ZERO))
    if PROCESS in runs:  # --worker-type ray: the aioloader column is Ray's
        rows[1:1] = ray_rows(workload, runs["aioloader"], runs[PROCESS])
    lag_ours, lag_torch = LAGGED_SIDES
    if lag_ours in runs:  # --lag: the ticker's lateness beside torch consumed in the loop
        rows += [_row(workload, metric, f"{label} [direct]", runs[lag_ours], runs[lag_torch],
                      lag_torch.removeprefix(LAGGED))
                 for metric, label in LAG_METRICS if metric != "batches_per_s"]
    return rows


def ray_rows(workload: str, ray: Sequence[Result], process: Sequence[Result]) -> list[Row]:
    """Ray workers (the aioloader column) against worker processes (the torch column), and
    what Ray costs per batch: 1/rate(Ray) - 1/rate(processes) of each pair, in ms."""
    rows = [_row(workload, metric, f"{label} ray|process", ray, process, PROCESS)
            for metric, label in (("batches_per_s", "batches/s"),
                                  ("cpu_ms_per_batch", "main CPU ms/batch"))]
    costs = [1e3 / r - 1e3 / p for r, p in zip(_values(ray, "batches_per_s"),
                                                _values(process, "batches_per_s"),
                                                strict=False) if r > 0 and p > 0]
    rows.append(Row(workload, "ray_ms_per_batch", "ray cost ms/batch", median(costs),
                    math.nan, math.nan, min(costs, default=math.nan),
                    max(costs, default=math.nan), PROCESS))
    return rows


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "-"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def table(rows: Sequence[Row]) -> str:
    """The side-by-side table, plain text: a column per peer that ran, when any did."""
    peers = [p for p in PEERS if any(p in r.peers for r in rows)]
    head = ("workload", "metric", "aioloader", "torch", *peers, "ratio (min-max)",
            *(["aioloader / best peer"] if peers else []))
    cells = [(r.workload, r.label, _fmt(r.aioloader), _fmt(r.torch),
              *(_fmt(r.peers.get(p, math.nan)) for p in peers),
              "-" if math.isnan(r.ratio)
              else f"{_fmt(r.ratio)} ({_fmt(r.ratio_min)}-{_fmt(r.ratio_max)})",
              *([f"{_fmt(r.best_ratio)} ({r.best_peer})" if r.best_peer else "-"]
                if peers else []))
             for r in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    numeric = range(2, 4 + len(peers))  # right-aligned
    lines = []
    for k, c in enumerate([head, *cells]):
        if k > 1 and c[0] != cells[k - 2][0]:
            lines.append("")
        lines.append("  ".join(f"{v:>{w}}" if i in numeric else f"{v:<{w}}"
                               for i, (v, w) in enumerate(zip(c, widths, strict=True))
                               ).rstrip())
    return "\n".join(lines)


def legend(rows: Sequence[Row]) -> str:
    """What each metric of the table means, one line each, in the table's order."""
    labels: dict[str, str] = {}
    for r in rows:
        labels.setdefault(r.metric, r.label.split(" [")[0].split(" @")[0].split(" ray|")[0])
    width = max((len(label) for label in labels.values()), default=0)
    lines = textwrap.wrap(RATIO_MEANING, LEGEND_WIDTH)
    for metric, label in labels.items():
        if metric in MEANINGS:
            lines += textwrap.wrap(MEANINGS[metric], LEGEND_WIDTH,
                                   initial_indent=f"{label:<{width}}  ",
                                   subsequent_indent=" " * (width + 2))
    return "\n".join(lines)


def targets_header(note: str) -> str:
    """The line above the targets: what they are, without the tracker's issue numbers."""
    return f"targets (what aioloader is built to reach on these workloads; {note}):"


def targets(rows: Sequence[Row], machine: Result, start_method: str) -> list[Target]:
    """The throughput and loop-lag targets, for the workloads that ran."""
    found = {(r.workload, r.label): r for r in rows}
    out: list[Target] = []

    def ratio_at_least(workload: str, label: str, goal: float) -> None:
        row = found.get((workload, label))
        if row is not None:
            out.append(Target(f"{workload} {label} >= {goal:g}x torch",
                              f"{_fmt(row.ratio)}x", row.ratio >= goal))

    ratio_at_least("tiny", "batches/s", 3.0)
    zero, tiny = found.get(("tiny", "batches/s @0 workers")), found.get(("tiny", "batches/s"))
    if zero is not None and tiny is not None:
        out.append(Target("tiny batches/s >= aioloader's own at num_workers=0",
                          f"{_fmt(tiny.aioloader)} vs {_fmt(zero.aioloader)}",
                          tiny.aioloader >= zero.aioloader))
    ratio_at_least("image", "MB/s", 2.0)
    image = found.get(("image", "MB/s"))
    memcpy = float(machine.get("memcpy_gbps", math.nan)) * 1000
    if image is not None:
        out.append(Target("image MB/s >= 50% of memcpy",
                          f"{image.aioloader / memcpy:.0%} of {_fmt(memcpy)} MB/s",
                          image.aioloader >= 0.5 * memcpy))
    ratio_at_least("text", "batches/s", 2.0)
    ratio_at_least("cpu", "batches/s", 1.0)
    first_goal = 1.0 if start_method == "fork" else 0.5
    for (workload, label), row in found.items():
        if label == "first batch ms":
            out.append(Target(f"{workload} first batch <= {first_goal:g}x torch "
                              f"({start_method})", f"{_fmt(row.ratio)}x",
                              row.ratio <= first_goal))
    for (workload, label), row in found.items():
        if label == "epoch stall ms":
            out.append(Target(f"{workload} epoch stall <= 10 ms", f"{_fmt(row.aioloader)} ms",
                              row.aioloader <= 10.0))
    for (workload, label), row in found.items():
        if label == LAG_P99:
            name = "loop-lag p99" if workload == LAG else f"{workload} lag p99"
            out.append(Target(f"{name} <= 1 ms", f"{_fmt(row.aioloader)} ms "
                              f"(torch {_fmt(row.torch)} ms; the loop's floor "
                              f"{_fmt(machine['woken_lag_p99_ms'])} ms)", row.aioloader <= 1.0))
    for (workload, label), row in found.items():
        if label == "main CPU ms/batch":
            out.append(Target(f"{workload} main CPU/batch <= 0.3x torch", f"{_fmt(row.ratio)}x",
                              row.ratio <= 0.3))
    return out


def target_lines(found: Sequence[Target], *, judged: bool = True) -> str:
    """A line a target: PASS or MISS, what was asked, what was measured. ``judged=False``
    (``--quick``, whose tiny runs measure nothing): ``n/a`` in place of the verdict."""
    width = max((len(t.name) for t in found), default=0)
    return "\n".join(f"{verdict(t.passed, judged):<4}  {t.name:<{width}}  {t.measured}"
                     for t in found)


def verdict(passed: bool, judged: bool, words: tuple[str, str] = ("PASS", "MISS")) -> str:
    """``words[0]`` or ``words[1]`` for a target met or missed; ``n/a`` when not judged."""
    if not judged:
        return "n/a"
    return words[0] if passed else words[1]


QUICK_NOTE = "not judged: --quick checks the plumbing, not the targets"


def machine_lines(machine: Result, header: str) -> str:
    """What the machine offers, printed before the table."""
    return "\n".join([
        header,
        f"machine: {machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), "
        f"torch {machine['torch']}, Python {machine['python']}, aioloader {machine['aioloader']}",
        f"memcpy, 1 thread:  {machine['memcpy_gbps']:.2f} GB/s "
        "(torch copy_ of 64 MB uint8 into a preallocated tensor, best of 8)",
        f"pipe round trip:   {machine['pipe_rtt_us']:.1f} us (os.pipe ping-pong, 2 processes)",
        f"idle 1 ms ticker:  lag p50 {machine['idle_lag_p50_ms']:.3f} ms, "
        f"p99 {machine['idle_lag_p99_ms']:.3f} ms (nothing streaming)",
        f"woken 1 ms ticker: lag p50 {machine['woken_lag_p50_ms']:.3f} ms, "
        f"p99 {machine['woken_lag_p99_ms']:.3f} ms (another process wakes the loop "
        f"{WAKES_PER_S} times a second and it does nothing else: the loop's own floor)",
    ])
