"""`aioloader bench`: runs end to end, reports every metric, rejects bad flags (no timings)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import aioloader
from aioloader.__main__ import main as cli_main
from aioloader.bench._measure import percentile
from aioloader.bench._peers import NODES, SPDL_PROCESS, SPDL_THREAD, STATEFUL
from aioloader.bench._report import (
    MEANINGS,
    QUICK_NOTE,
    THROUGHPUT_METRICS,
    Target,
    target_lines,
    targets_header,
)
from aioloader.bench._step import consumer_step, fetch_ms, matmul_ms, reps_for
from aioloader.bench._workloads import WORKLOADS, TextDataset, torch_pad_collate
from aioloader.testing import members

HARD_TIMEOUT = 300.0
METRIC_LABELS = [label for _, label in THROUGHPUT_METRICS]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m aioloader ARGS`` in a session of its own; nothing of it may outlive it."""
    proc = subprocess.Popen([sys.executable, "-m", "aioloader", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        deadline = time.monotonic() + 10
        while (left := members(session=proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of the bench outlived it: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def quick_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, object]]:
    path = tmp_path_factory.mktemp("bench") / "results.json"
    done = _run_cli("bench", "--quick", "--workloads", "tiny", "--json", str(path))
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(path.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and reads /proc")
def test_quick_tiny_prints_machine_table_and_targets(
        quick_tiny: tuple[str, dict[str, object]]) -> None:
    out, _ = quick_tiny
    assert "memcpy" in out and "pipe round trip" in out and f"torch {torch.__version__}" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert header.split()[:4] == ["workload", "metric", "aioloader", "torch"]
    assert "ratio" in header
    for label in METRIC_LABELS:
        row = next((line for line in lines if line.startswith("tiny") and label in line), None)
        assert row is not None, f"no row for {label!r}:\n{out}"
        tail = row.split(label, 1)[1].split()
        float(tail[0])  # a figure for aioloader, and one for torch unless it has none
        if label != "data stall %":
            float(tail[1])
    assert any(line.startswith("n/a") and "tiny batches/s >= 3x torch" in line
               for line in lines)


def test_quick_tiny_says_what_each_figure_means(
        quick_tiny: tuple[str, dict[str, object]]) -> None:
    """Under the table, a line per metric in the user's words (issue 36): the data stall's
    near-100 % explained as this consumer's doing; no tracker numbers anywhere."""
    out, _ = quick_tiny
    legend = " ".join(out.split("\n\n")[-3].split())  # the lines under the table, unwrapped
    for metric, label in THROUGHPUT_METRICS:
        assert f"{label} {MEANINGS[metric]}" in legend, f"{label!r}:\n{out}"
    assert "near 100 % is expected" in MEANINGS["data_stall_pct"]
    assert "issue" not in out.lower(), out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and reads /proc")
def test_quick_lists_the_targets_without_verdicts(
        quick_tiny: tuple[str, dict[str, object]]) -> None:
    """--quick measures nothing, so it judges no target: n/a, and why, said once."""
    out, doc = quick_tiny
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith(("PASS", "MISS"))], out
    assert out.count(QUICK_NOTE) == 1
    start = lines.index(targets_header(QUICK_NOTE)) + 1
    listed = list(itertools.takewhile(bool, lines[start:]))
    assert listed and all(line.startswith("n/a  ") for line in listed), out
    judged = doc["targets"]
    assert isinstance(judged, list) and judged and all(t["passed"] is None for t in judged)


def test_target_lines_judge_unless_told_not_to() -> None:
    found = [Target("tiny batches/s >= 3x torch", "3.10x", True),
             Target("cpu batches/s >= 1x torch", "0.50x", False)]
    assert [line.split()[0] for line in target_lines(found).splitlines()] == ["PASS", "MISS"]
    quick = target_lines(found, judged=False).splitlines()
    assert [line.split()[0] for line in quick] == ["n/a", "n/a"]
    assert [line.index(t.name) for line, t in zip(quick, found, strict=True)] == [6, 6]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and reads /proc")
def test_quick_tiny_json_holds_runs_and_summary(
        quick_tiny: tuple[str, dict[str, object]]) -> None:
    _, doc = quick_tiny
    assert set(doc) >= {"config", "machine", "workloads", "targets"}
    machine = doc["machine"]
    assert isinstance(machine, dict) and machine["memcpy_gbps"] > 0
    assert machine["woken_lag_p99_ms"] >= machine["woken_lag_p50_ms"] > 0
    tiny = doc["workloads"]["tiny"]  # type: ignore[index]
    for side in ("aioloader", "torch", "aioloader@0"):
        (run,) = tiny["runs"][side]
        assert {"batches_per_s", "mb_per_s", "ttfb_ms", "stall_ms", "cpu_ms_per_batch",
                "faults_per_batch", "peak_rss_mb"} <= set(run)
    metrics = {row["metric"] for row in tiny["summary"]}
    assert {"batches_per_s", "ttfb_ms", "stall_ms", "cpu_ms_per_batch"} <= metrics
    for row in tiny["summary"]:
        assert {"aioloader", "torch", "ratio", "ratio_min", "ratio_max"} <= set(row)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and reads /proc")
def test_quick_peers_add_a_column_each_and_the_best_peer_ratio() -> None:
    pytest.importorskip("PIL", reason="the decode workload needs Pillow")
    expected = []
    if _installed("spdl.pipeline"):
        expected += [SPDL_THREAD, SPDL_PROCESS]
    if _installed("torchdata.nodes"):
        expected += [STATEFUL, NODES]
    if not expected:
        pytest.skip("no peer installed (spdl, torchdata)")
    done = _run_cli("bench", "--quick", "--peers", "--workloads", "image-alloc,decode")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert header.split()[:4 + len(expected)] == ["workload", "metric", "aioloader", "torch",
                                                  *expected]
    assert header.endswith("aioloader / best peer")
    for workload in ("image-alloc", "decode"):
        row = next(line for line in lines if line.startswith(workload) and "batches/s" in line)
        figures = row.split("batches/s", 1)[1].split()
        for figure in figures[:2 + len(expected)]:  # aioloader, torch, each peer
            assert float(figure) > 0, row
        assert figures[-1].strip("()") in ("torch", *expected), row  # the best peer, named


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_unknown_workload_exits_2_with_a_clear_error() -> None:
    done = _run_cli("bench", "--workloads", "tiny,nope")
    assert done.returncode == 2
    assert "error: argument --workloads: unknown workload 'nope'" in done.stderr
    assert "loop-lag" in done.stderr  # the valid choices are listed


@pytest.mark.parametrize("args", [
    ["bench", "--pairs", "0"],
    ["bench", "--batches", "many"],
    ["bench", "--start-method", "vfork"],
    ["bench", "--workloads", ","],
    ["bench", "--step-ms", "0"],
    ["bench", "--step-ms", "soon"],
    ["bench", "--step-threads", "-1"],
    ["frobnicate"],
    [],
])
def test_bad_flags_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(args)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_consumer_step_is_calibrated_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--step-ms``: as many matmuls as make the step asked for, and none for no step."""
    assert reps_for(0.0, 0.1) == 0 and reps_for(1.0, 0.1) == 10 and reps_for(0.01, 0.1) == 1
    assert matmul_ms() > 0 and fetch_ms(WORKLOADS["tiny"]) > 0
    calls: list[torch.Tensor] = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out: calls.append(mm(a, b, out=out)))
    consumer_step(0)()
    assert calls == []
    consumer_step(3)()
    assert len(calls) == 3


def test_the_consumer_step_runs_on_the_threads_asked_and_puts_torchs_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--step-threads 1``: the step's matmuls see one intra-op thread; the caller's own
    count (its fetches, torch's ``num_workers=0``) is back after each step."""
    seen: list[int] = []
    monkeypatch.setattr(torch, "mm", lambda a, b, out: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    consumer_step(2, threads=1)()
    assert seen == [1, 1]
    assert torch.get_num_threads() == before


def test_torch_pad_collate_matches_pad_collate() -> None:
    samples = [TextDataset(8)[i] for i in range(8)]
    ours, theirs = aioloader.PadCollate()(samples), torch_pad_collate(samples)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype
        assert torch.equal(ours[key], theirs[key])


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
