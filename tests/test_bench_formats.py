"""The formats workload (issue 35): its data, and each aioloader configuration reads all of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioloader.bench import _formats

pytest.importorskip("pyarrow")
pytest.importorskip("PIL")
pytestmark = pytest.mark.deadline(120)


@pytest.mark.parametrize("kind", ["wds raw", "wds jpeg", "wds http", "parquet rows",
                                  "parquet batches"])
def test_each_aioloader_run_reads_the_whole_data(tmp_path: Path, kind: str) -> None:
    data = _formats.write_data(str(tmp_path), quick=True)
    with _formats.served_shards(str(tmp_path), data["shards"]) as url:
        result = _formats._aioloader(kind, {**data, "http": url}, 1)
    expected = data["samples"] if kind.startswith("wds") else data["rows"]
    assert result["samples"] == expected
    assert result["per_s"] > 0 and result["mem_mb"] >= 0


def test_the_table_compares_with_the_best_peer() -> None:
    rows = [{"workload": "parquet", "loader": "aioloader rows", "per_s": 300.0, "mem_mb": 5.0},
            {"workload": "parquet", "loader": "hf a", "per_s": 100.0, "mem_mb": 1.0},
            {"workload": "parquet", "loader": "hf b", "per_s": 150.0, "mem_mb": 1.0}]
    line = next(x for x in _formats.table(rows).splitlines() if "aioloader rows" in x)
    assert "| 2.00x |" in line
