"""torch.distributed: ranks x workers cover the data exactly once; even batches per rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import dist_helpers

N = 40
CASES = ["reader_cached", "reader_lazy", "map_style", "map_style_shuffled", "iterable"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict]]:
    out = tmp_path_factory.mktemp("ranks")
    dist_helpers.run_ranks(dist_helpers.rank_main, 2, str(out), N)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


@pytest.mark.parametrize("case", CASES)
def test_ranks_times_workers_see_every_instance_once(two_ranks, case):
    seen = two_ranks[0][case]["indices"] + two_ranks[1][case]["indices"]
    assert sorted(seen) == list(range(N)), f"{case}: {sorted(seen)}"


@pytest.mark.parametrize("case", CASES)
def test_even_batches_give_every_rank_the_same_number(two_ranks, case):
    assert two_ranks[0][case]["batches"] == two_ranks[1][case]["batches"]


def test_a_datapipe_is_split_by_rank_then_worker_as_torchs(
        tmp_path: Path) -> None:
    # torch's loader applies a datapipe's sharding over ranks x workers (rank r's worker w
    # keeps w * world + r of workers * world); ours split it by worker only: every rank
    # read it whole, each instance once per rank
    dist_helpers.run_ranks(dist_helpers.datapipe_main, 2, str(tmp_path), 21)
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    for workers in ("0", "1", "2"):
        for rank in (0, 1):
            got = seen[rank][workers]
            assert got["ours"] == got["torch"], (rank, workers, got["ours"], got["torch"])
        union = seen[0][workers]["ours"] + seen[1][workers]["ours"]
        assert sorted(union) == list(range(21)), (workers, union)
        # even_batches (the default) keeps the ranks in step: rank 1 (10 of 21) repeats
        # its own first instance once, where torch's ranks end apart
        assert seen[0][workers]["ours_even"] == seen[0][workers]["torch"]
        assert seen[1][workers]["ours_even"] == seen[1][workers]["torch"] + [1], workers
