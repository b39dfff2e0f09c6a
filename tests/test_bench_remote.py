"""`aioloader bench --workloads remote --quick`: runs end to end and reports every row.

One small run (200 objects, concurrency 1 and 8, one pair) against the local object
server; its timings are not checked, only that each configuration has its figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aioloader.__main__ import main as cli_main
from aioloader.bench._remote import spdl_missing

sys.path.insert(0, str(Path(__file__).parent / "scripts_resume"))
from resume_harness import Expired, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="forks and reads /proc")

HARD_TIMEOUT = 120.0
HAS_SPDL = spdl_missing() is None


@pytest.mark.deadline(HARD_TIMEOUT + 30)
def test_quick_run_reports_every_configuration(tmp_path: Path) -> None:
    path = tmp_path / "remote.json"
    try:
        done = run_python(["-m", "aioloader", "bench", "--workloads", "remote", "--quick",
                           "--json", str(path)], HARD_TIMEOUT)
    except Expired as exc:
        pytest.fail(f"the bench {exc}")
    assert done.returncode == 0, done.stdout[-4000:]
    out = done.stdout
    names = ["ceiling", "torch", "aioloader c=1", "aioloader c=8"]
    if HAS_SPDL:
        names += ["spdl k=1", "spdl k=2", "spdl k=8", "spdl k=16"]
    else:
        assert "note: spdl is not installed" in out
    lines = out.splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("config"))
    table = lines[head + 1:head + 1 + len(names)]
    assert sorted(line.split("  ")[0].strip() for line in table) == sorted(names), out
    assert "aioloader c=8 memory: peak growth" in out
    assert "server ceiling (plain aiohttp" in out

    remote = json.loads(path.read_text())["workloads"]["remote"]
    assert remote["config"]["concurrency"] == [1, 8]
    rows = {row["name"]: row for row in remote["summary"]}
    assert sorted(rows) == sorted(names)
    for name in names:
        assert rows[name]["objects_per_s"] > 0 and rows[name]["mb_per_s"] > 0, rows[name]
    for c in (1, 8):
        row = rows[f"aioloader c={c}"]
        assert row["inflight"] == 2 * c and row["x_torch"] > 0
        assert row["bound_mb"] > row["arena_mb"] > 0
        if HAS_SPDL:
            assert row["x_spdl_equal"] > 0 and row["x_spdl_c"] > 0


@pytest.mark.parametrize("value", ["0", "8,x", ""])
def test_concurrency_must_be_positive_integers(value: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--workloads", "remote", "--concurrency", value])
    assert exc.value.code == 2
    assert "--concurrency" in capsys.readouterr().err
