"""Resume on another world size and another num_workers, on real gloo ranks (issue 21).

2 ranks take 4 batches each of epoch 0 and save their states; then 1 rank (num_workers=0)
and 4 ranks (num_workers=1) load all of them. Across the ranks of both runs every instance
of epoch 0 is seen once (even_batches' padding aside), for a map-style dataset, a cached
reader and a lazy one; on one rank a map-style epoch goes on in its global order; the next
epoch is the new world size's own.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts_issue9"))

N = {"map": 37, "cached": 41, "lazy": 41}


def _ranks(tmp: Path, shared: Path, cases: list[str], world: int,
           monkeypatch: pytest.MonkeyPatch) -> dict[int, Any]:
    import issue9_dist

    monkeypatch.setenv("RESHAPE_DIR", str(shared))
    out = tmp / f"out-{world}-{cases[0]}"
    out.mkdir()
    ranks = issue9_dist.run_ranks(out, cases, deadline=240, world=world,
                                  registry="reshape_dist")
    for r, got in ranks.items():
        for case in cases:
            assert "error" not in got[case], f"rank {r}, {case}: {got[case]['error']}"
    return ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    tmp = tmp_path_factory.mktemp("reshape")
    shared = tmp / "states"
    shared.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        return shared, _ranks(tmp, shared, ["save"], 2, mp)


@pytest.mark.deadline(300)
@pytest.mark.parametrize("world", [1, 4])
def test_resumed_on_another_world_size_every_instance_once(
        saved: tuple[Path, dict[int, Any]], world: int, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    shared, before = saved
    after = _ranks(tmp_path, shared, ["resume"], world, monkeypatch)
    for name, n in N.items():
        taken = [i for r in (0, 1) for b in before[r]["save"][name]["taken"] for i in b]
        rest = [i for r in range(world) for b in after[r]["resume"][name]["rest"] for i in b]
        seen = collections.Counter(taken + rest)
        assert set(seen) == set(range(n)), name
        assert sum(c - 1 for c in seen.values()) <= world * 3, name  # even_batches' padding
        counts = {len(after[r]["resume"][name]["rest"]) for r in range(world)}
        if name != "lazy":  # (a stream's ranks end where their shards end, as in any pass)
            assert len(counts) == 1, f"{name}: the ranks disagree on the batch count {counts}"
        for r in range(world):
            got = after[r]["resume"][name]
            assert got["next"] == got["whole_next"], f"{name}, rank {r}: epoch 1"
            assert got["again_pass"] == 1
        if name == "map" and world == 1:  # the global order goes on
            whole = [i for b in after[0]["resume"][name]["whole"] for i in b]
            assert rest == [i for i in whole if i not in set(taken)]
        assert before[0]["save"][name]["bytes"] < 1024


@pytest.mark.deadline(300)
def test_a_state_taken_inside_a_resumed_epoch_resumes_it_again(
        saved: tuple[Path, dict[int, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    shared, _ = saved
    after = _ranks(tmp_path, shared, ["resume_inside"], 4, monkeypatch)
    for r in range(4):
        for name in ("map", "cached"):
            got = after[r]["resume_inside"][name]
            assert got["resumed"] == got["rest"], f"{name}, rank {r}"
