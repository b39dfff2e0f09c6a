"""`aioloader bench --lag` and `--workloads first-batch`: they run and report (no timings)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_bench import _run_cli

from aioloader.bench._cli import main as bench_main
from aioloader.bench._measure import aio_loader
from aioloader.bench._report import FIRST_METRICS, LAG_METRICS
from aioloader.bench._runner import (
    LAGGED_SIDES,
    Plan,
    default_batches,
    sides,
    spec_for,
)
from aioloader.bench._workloads import FIRST, LAG, WORKLOADS

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and reads /proc")
LAG_LABELS = [f"{label} [direct]" for metric, label in LAG_METRICS if metric != "batches_per_s"]
LAG_FIGURES = {"lag_p50_ms", "lag_p99_ms", "lag_max_ms", "start_lag_ms", "ticks", "epochs"}


def _row(lines: list[str], workload: str, label: str) -> list[float]:
    """The figures of ``workload``'s ``label`` row: aioloader's and torch's."""
    row = next((line for line in lines if line.startswith(f"{workload} ") and label in line),
               None)
    assert row is not None, f"no {workload} row for {label!r}:\n" + "\n".join(lines)
    return [float(v) for v in row.split(label, 1)[1].split()[:2]]


@LINUX
def test_quick_lag_adds_lag_rows_to_each_workload_and_a_target(tmp_path: Path) -> None:
    path = tmp_path / "lag.json"
    done = _run_cli("bench", "--quick", "--lag", "--face", "sync", "--workloads", "tiny,text",
                    "--json", str(path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "lag runs >= " in lines[0]
    for workload in ("tiny", "text"):
        _row(lines, workload, "batches/s")  # the throughput rows are still there
        for label in LAG_LABELS:
            ours, torch = _row(lines, workload, label)
            assert ours >= 0 and torch >= 0
        assert any(line.startswith("n/a") and f"{workload} lag p99 <= 1 ms" in line
                   for line in lines)  # listed; --quick judges no target
    doc = json.loads(path.read_text())
    assert doc["config"]["lag"] is True
    for workload in ("tiny", "text"):
        runs = doc["workloads"][workload]["runs"]
        assert set(LAGGED_SIDES) <= set(runs)
        for side in LAGGED_SIDES:
            (run,) = runs[side]
            assert set(run) >= LAG_FIGURES and run["ticks"] >= 1
            assert run["lag_p50_ms"] <= run["lag_p99_ms"] <= run["lag_max_ms"]


@LINUX
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_quick_first_batch_reports_each_step_against_torch(
        start_method: str, tmp_path: Path) -> None:
    path = tmp_path / "first.json"
    done = _run_cli("bench", "--quick", "--workloads", FIRST, "--start-method", start_method,
                    "--json", str(path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "batches/epoch" not in lines[0]  # the first-batch workload has no epochs to show
    for _, label in FIRST_METRICS:
        ours, torch = _row(lines, FIRST, label)
        assert ours > 0 and torch > 0
    goal = "1x" if start_method == "fork" else "0.5x"
    assert any(f"{FIRST} first batch <= {goal} torch ({start_method})" in line
               for line in lines)
    doc = json.loads(path.read_text())
    runs = doc["workloads"][FIRST]["runs"]
    assert set(runs) == {"aioloader", "torch"}
    for (run,) in runs.values():
        assert 0 < run["construct_ms"] < run["ttfb_ms"] and run["close_ms"] > 0


def _plan(lag: bool) -> Plan:
    return Plan(num_workers=2, start_method="fork", pairs=1, batches=default_batches(True),
                face="sync", loop="asyncio", timeout=60.0, lag=lag, lag_min_s=0.5)


def test_lag_sides_follow_each_throughput_workload_and_run_async() -> None:
    assert not set(LAGGED_SIDES) & set(sides("image", 2, lag=False))
    assert sides("image", 2, lag=True)[-2:] == LAGGED_SIDES
    assert sides("tiny", 2, ("spdl-thread",), lag=True)[-2:] == LAGGED_SIDES
    assert not set(LAGGED_SIDES) & set(sides(FIRST, 2, lag=True))
    assert not set(LAGGED_SIDES) & set(sides(LAG, 2, lag=True))
    plan = _plan(lag=True)
    ours, torch = (spec_for(plan, "decode", side) for side in LAGGED_SIDES)
    assert (ours.kind, ours.side, ours.face, ours.workload, ours.min_s) == (
        "lag", "aioloader", "async", "decode", 0.5)
    assert (torch.kind, torch.side) == ("lag", "torch-direct")
    assert spec_for(plan, "decode", "aioloader").kind == "throughput"
    assert spec_for(plan, "decode", "aioloader").face == "sync"
    first = spec_for(plan, FIRST, "torch")
    assert (first.kind, first.side, first.start_method) == ("first", "torch", "fork")


def test_worker_nice_reaches_aioloader_workers_only() -> None:
    plan = replace(_plan(lag=True), worker_nice=7)
    niced = {side: spec_for(plan, "tiny", side).worker_nice
             for side in sides("tiny", 2, ("spdl-thread",), lag=True)}
    assert niced.pop("aioloader") == niced.pop(LAGGED_SIDES[0]) == 7
    assert set(niced.values()) == {0}  # torch, the peers, torch's lag run, num_workers=0
    loader = aio_loader(spec_for(plan, "tiny", "aioloader"), WORKLOADS["tiny"], [0, 1])
    assert loader.worker_nice == 7
    loader.close()


@pytest.mark.parametrize("argv", [["--worker-nice", "20"],
                                  ["--worker-nice", "3", "--num-workers", "0"]])
def test_worker_nice_out_of_range_is_a_usage_error(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench_main(["--quick", "--workloads", "tiny", *argv])
    assert info.value.code == 2
    assert "--worker-nice" in capsys.readouterr().err
