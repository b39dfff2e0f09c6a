"""`aioloader bench --workloads resume`: runs end to end on a small epoch (no timings checked).

Two runs of 20,000 items, one round each: states made by editing the position fields
(the default) and states made by consuming to each position. Both must resume each side
at the same first batch, and aioloader's ``__getitem__`` count before the first batch must
not grow with the position.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from aioloader.__main__ import main as cli_main
from aioloader.bench._resume import torchdata_missing

sys.path.insert(0, str(Path(__file__).parent / "scripts_resume"))
from resume_harness import Expired, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="forks and reads /proc")

HARD_TIMEOUT = 300.0
ITEMS = 20_000
POSITIONS = ["0%", "10%", "50%", "90%"]
HAS_TORCHDATA = torchdata_missing() is None
SIDES = ["aioloader", "torchdata"] if HAS_TORCHDATA else ["aioloader"]


def _bench(path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    try:
        done = run_python(["-m", "aioloader", "bench", "--workloads", "resume", "--quick",
                           "--resume-items", str(ITEMS), "--num-workers", "2",
                           "--json", str(path), *extra], HARD_TIMEOUT)
    except Expired as exc:
        pytest.fail(f"the bench {exc}")
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout, json.loads(path.read_text())


@pytest.fixture(scope="module")
def edited(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return _bench(tmp_path_factory.mktemp("bench") / "edit.json")


@pytest.fixture(scope="module")
def consumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return _bench(tmp_path_factory.mktemp("bench") / "consume.json", "--resume-state",
                  "consume")


@pytest.mark.deadline(HARD_TIMEOUT + 30)
def test_prints_a_row_per_position(edited: tuple[str, dict[str, Any]]) -> None:
    out, _ = edited
    lines = out.splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("position"))
    assert lines[head].split()[:4] == ["position", "batch", "aioloader", "s"]
    rows = {line.split()[0]: line.split() for line in lines[head + 1:head + 5]}
    assert list(rows) == POSITIONS, out
    for cells in rows.values():
        int(cells[1])  # the batch
        float(cells[2])  # aioloader's seconds
        int(cells[-2])  # aioloader's __getitem__ count
        if HAS_TORCHDATA:
            float(cells[3])
            int(cells[-1])
        else:
            assert cells[3] == "-"
    if not HAS_TORCHDATA:
        assert "note: torchdata is not installed" in out
    assert "check: aioloader resumed from an edited state at batch 3 as from a consumed one" \
        in out


@pytest.mark.deadline(HARD_TIMEOUT + 30)
def test_json_holds_config_runs_and_summary(edited: tuple[str, dict[str, Any]]) -> None:
    _, doc = edited
    resume = doc["workloads"]["resume"]
    assert resume["config"]["items"] == ITEMS
    assert resume["config"]["positions"] == [0.0, 0.1, 0.5, 0.9]
    assert all(check["ok"] for check in resume["checks"].values())
    assert set(resume["checks"]) == set(SIDES)
    per_epoch = -(-ITEMS // 64)
    assert resume["config"]["batches"] == [0, round(0.1 * per_epoch), round(0.5 * per_epoch),
                                           round(0.9 * per_epoch)]
    for row in resume["summary"]:
        for side in SIDES:
            assert row[f"{side}_s"] > 0
        if HAS_TORCHDATA:
            assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]


@pytest.mark.deadline(HARD_TIMEOUT + 30)
def test_getitem_count_does_not_grow_with_the_position(
        edited: tuple[str, dict[str, Any]]) -> None:
    _, doc = edited
    for row in doc["workloads"]["resume"]["summary"]:
        # far below the 18,000 samples a resume at 90 % would fetch to skip them
        assert row["aioloader_getitem"] < ITEMS // 20, row


@pytest.mark.deadline(2 * HARD_TIMEOUT + 30)
def test_edited_and_consumed_states_resume_at_the_same_batch(
        edited: tuple[str, dict[str, Any]], consumed: tuple[str, dict[str, Any]]) -> None:
    _, by_edit = edited
    _, by_consume = consumed
    assert set(by_consume["workloads"]["resume"]["made_by"].values()) <= {"consume", "fresh"}
    for side in SIDES:
        for k, runs in by_edit["workloads"]["resume"]["runs"][side].items():
            again = by_consume["workloads"]["resume"]["runs"][side][k]
            assert runs[0]["first"] == again[0]["first"], f"{side} at batch {k}"


@pytest.mark.parametrize("args", [
    ["bench", "--workloads", "resume", "--resume-positions", "100"],
    ["bench", "--workloads", "resume", "--resume-positions", "ten"],
    ["bench", "--workloads", "resume", "--resume-state", "guess"],
    ["bench", "--workloads", "resume", "--resume-items", "1"],
])
def test_bad_resume_flags_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(args)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_resume_is_listed_among_the_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["bench", "--workloads", "nope"])
    assert "resume" in capsys.readouterr().err
