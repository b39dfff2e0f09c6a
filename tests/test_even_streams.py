"""even_batches over streams: ranks end together without losing anything (issue 33).

A rank whose pass is over repeats its pass's first batches while another rank still has
batches, as a cached reader's plan does; the repeats are counted in ``stats().padded`` and
are the rank's last batches of the epoch. Before, the epoch ended for every rank when the
first ran out, and the others' last batches were never seen: 3 of 219 instances on a
fresh epoch of 3 ranks; after 2 ranks x 2 workers stopped at 9 batches of a shuffled lazy
reader and resumed on 4 ranks, 2 of 480 (the 17th batch of ranks 2 and 3, one instance
each, while ranks 0 and 1 had 16).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rank_servers import RankServers

STEP = "chain_jobs:step"


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankServers]:
    with RankServers(4) as servers:
        yield servers


def real(result: dict[str, Any]) -> list[list[int]]:
    """A rank's batches but its repeats (its last ``padded`` batches)."""
    batches: list[list[int]] = result["batches"]
    return batches[: len(batches) - result["padded"]]


def check_once(results: list[dict[str, Any]], n: int, *,
               own: bool = True) -> collections.Counter[int]:
    """Every instance once in the ranks' own batches; ``own``: their repeats are theirs
    (in a resumed pass they are the first batches of the rank's shards of the pass, which
    an earlier shape may have delivered)."""
    seen = collections.Counter(i for r in results for b in real(r) for i in b)
    assert sorted(seen) == list(range(n)), f"missing {sorted(set(range(n)) - set(seen))}"
    assert max(seen.values()) == 1, [i for i, c in seen.items() if c > 1]
    for r in results if own else ():
        mine = {i for b in real(r) for i in b}
        repeats = r["batches"][len(r["batches"]) - r["padded"]:]
        assert all(i in mine for b in repeats for i in b), "a repeat of another rank's"
    return seen


@pytest.mark.deadline(240)
@pytest.mark.parametrize("kind", ["lazy", "cached"])
def test_three_ranks_lose_nothing_and_count_their_padding(ranks: RankServers,
                                                          kind: str) -> None:
    # 219 = 6 shards of 36 or 37: a shard of 37 has a 10th batch of one instance
    opts = dict(batch_size=4, shuffle=True, seed=1, max_instances_in_memory=8)
    results = ranks.run(3, STEP, kind, 219, 2, opts, None, None)
    check_once(results, 219)
    counts = {len(r["batches"]) for r in results}
    assert len(counts) == 1, counts  # in step
    padded = [r["padded"] for r in results]
    assert sum(padded) > 0 and max(padded) <= 2, padded  # at most a batch per worker's shard


@pytest.mark.deadline(240)
def test_two_ranks_resumed_on_four_see_every_instance_once(ranks: RankServers) -> None:
    opts = dict(batch_size=6, shuffle=True, seed=3, max_instances_in_memory=48)
    before = ranks.run(2, STEP, "lazy", 480, 2, opts, None, 9)
    after = ranks.run(4, STEP, "lazy", 480, 2, opts, [r["state"] for r in before], None)
    check_once(before + after, 480, own=False)
    assert len({len(r["batches"]) for r in after}) == 1
    assert [r["padded"] for r in after] == [1, 1, 0, 0]


@pytest.mark.deadline(240)
def test_drop_last_drops_instead(ranks: RankServers) -> None:
    opts = dict(batch_size=4, shuffle=True, seed=1, max_instances_in_memory=8,
                drop_last=True)
    results = ranks.run(3, STEP, "lazy", 219, 2, opts, None, None)
    seen = collections.Counter(i for r in results for b in r["batches"] for i in b)
    assert max(seen.values()) == 1
    assert all(len(b) == 4 for r in results for b in r["batches"])
