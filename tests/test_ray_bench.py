"""`aioloader bench --worker-type ray`: the sides, the rows, the flags, and a quick run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioloader.__main__ import main as cli_main
from aioloader.bench._report import ray_rows
from aioloader.bench._runner import PROCESS, Plan, sides, spec_for
from aioloader.testing import members


def plan(worker_type: str) -> Plan:
    return Plan(num_workers=2, start_method="fork", pairs=1, batches={"tiny": 3, "image": 3},
                face="async", loop="asyncio", timeout=60.0, worker_type=worker_type)


def test_ray_runs_beside_processes_in_the_same_pairs() -> None:
    assert sides("image", 2, worker_type="ray") == ("aioloader", PROCESS, "torch")
    assert PROCESS not in sides("image", 2)
    assert PROCESS not in sides("loop-lag", 2, worker_type="ray")  # throughput only
    ray, process = spec_for(plan("ray"), "image", "aioloader"), spec_for(plan("ray"), "image",
                                                                          PROCESS)
    assert (ray.side, ray.worker_type) == ("aioloader", "ray")
    assert (process.side, process.worker_type) == ("aioloader", "process")
    assert spec_for(plan("process"), "image", "aioloader").worker_type == "process"


def test_ray_rows_give_the_cost_per_batch_of_each_pair() -> None:
    ray = [{"batches_per_s": 100.0, "cpu_ms_per_batch": 2.0},
           {"batches_per_s": 50.0, "cpu_ms_per_batch": 3.0}]
    process = [{"batches_per_s": 200.0, "cpu_ms_per_batch": 1.0},
               {"batches_per_s": 100.0, "cpu_ms_per_batch": 1.0}]
    rate, cpu, cost = ray_rows("image", ray, process)
    assert rate.label == "batches/s ray|process" and rate.ratio == pytest.approx(0.5)
    assert cpu.ratio == pytest.approx(2.5)
    assert cost.metric == "ray_ms_per_batch"
    assert (cost.ratio_min, cost.ratio_max) == (pytest.approx(5.0), pytest.approx(10.0))
    assert cost.aioloader == pytest.approx(7.5) and math.isnan(cost.torch)


def test_ray_without_workers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--worker-type", "ray", "--num-workers", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--worker-type ray" in err


@pytest.mark.leaks_ok  # checked below: nothing of the bench's session may outlive it
@pytest.mark.deadline(240)
def test_quick_ray_bench_runs_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    path = tmp_path / "ray.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioloader", "bench", "--quick", "--workloads", "tiny",
         "--worker-type", "ray", "--json", str(path)],
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        deadline = time.monotonic() + 15
        while (left := members(session=proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)  # Ray's own processes end on their own schedule: look again
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert not left, f"processes of the bench outlived it: {left}"
    assert "left processes" not in err, err
    assert "batches/s ray|process" in out and "ray cost ms/batch" in out
    document = json.loads(path.read_text())
    assert document["config"]["worker_type"] == "ray"
    assert set(document["workloads"]["tiny"]["runs"]) >= {"aioloader", PROCESS, "torch"}
