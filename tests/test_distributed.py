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
