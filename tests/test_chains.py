"""Elastic resume, exactly once, any number of times: random chains of job shapes (issue 33).

Hypothesis draws a source kind (map-style with the loader's sampling, a cached and a lazy
reader, a self-splitting IterableDataset, keys with an unordered load stage), the loader's
options (batch size, shuffle and seed, drop_last, even_batches, a block size) and a chain
of three or four shapes (1-4 gloo ranks x 0-3 workers; an IterableDataset that splits
itself keeps its shape, the only one it resumes on), each stopped after a random number of
batches, its ranks' states handed to the next shape; the last one finishes the pass.
Across the chain:

* without ``drop_last``, every instance of the pass is seen at least once;
* a stream's rank repeats batches only at its pass's end, and counts them
  (``stats().padded``): without them, every instance at most once (exactly once without
  ``drop_last``);
* without ``even_batches`` (no padding asked for), exactly once, or at most once with
  ``drop_last``.

The ranks are :class:`rank_servers.RankServers`: spawned once per source kind, every shape a
real gloo job of its own (see there for why). Settings: ``MAX_EXAMPLES`` examples per
source kind, derandomized (the same examples every run), no
per-example deadline (a shape starts processes; the test has its own deadline).
"""

from __future__ import annotations

import collections
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from rank_servers import RankServers

STEP = "chain_jobs:step"
MAX_EXAMPLES = int(os.environ.get("CHAINS_EXAMPLES", "6"))  # per source kind
STREAMS = ("lazy", "unordered", "iterable")


@pytest.fixture
def ranks() -> Iterator[RankServers]:
    with RankServers(4) as servers:
        yield servers
        assert servers.retries <= 2, f"gloo's set-up failed {servers.retries} times"


@st.composite
def chains(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    batch_size = draw(st.integers(1, 5))
    opts: dict[str, Any] = {
        "batch_size": batch_size, "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 3)), "drop_last": draw(st.booleans()),
        "even_batches": draw(st.booleans())}
    if kind in STREAMS:
        opts["max_instances_in_memory"] = batch_size * draw(st.integers(1, 4))
    shape = st.tuples(st.integers(1, 4), st.integers(0, 3))
    if kind == "iterable":
        shapes = [draw(shape)] * draw(st.integers(3, 4))
    else:
        shapes = draw(st.lists(shape, min_size=3, max_size=4))
    stops = [draw(st.integers(0, 8)) for _ in shapes[:-1]]
    return {"kind": kind, "n": draw(st.integers(10, 90)), "opts": opts, "shapes": shapes,
            "stops": [*stops, None]}


def run_chain(ranks: RankServers, chain: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each shape's results, by rank."""
    states: list[Any] | None = None
    out = []
    if os.environ.get("CHAINS_LOG"):  # which example runs (a hang is found by its last)
        with open(os.environ["CHAINS_LOG"], "a") as log:
            print(json.dumps(chain), file=log)
    for (world, workers), stop in zip(chain["shapes"], chain["stops"], strict=True):
        results = ranks.run(world, STEP, chain["kind"], chain["n"], workers, chain["opts"],
                            states, stop)
        states = [r["state"] for r in results]
        out.append(results)
    return out


@pytest.mark.deadline(600)
@pytest.mark.parametrize("kind", ["map", "cached", "lazy", "iterable", "unordered"])
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_instance_once_across_random_chains_of_shapes(ranks: RankServers, kind: str,
                                                           data: st.DataObject) -> None:
    chain = data.draw(chains(kind))
    check(chain, run_chain(ranks, chain))


def check(chain: dict[str, Any], shapes: list[list[dict[str, Any]]]) -> None:
    """The chain's claims (see the module docstring) on what each shape's ranks saw."""
    kind, n, opts = chain["kind"], chain["n"], chain["opts"]
    everything = collections.Counter(
        i for results in shapes for r in results for b in r["batches"] for i in b)
    if not opts["drop_last"]:
        missing = sorted(set(range(n)) - set(everything))
        assert not missing, f"{chain}: missing {missing}"
    if kind in STREAMS:
        own = collections.Counter(
            i for results in shapes for r in results
            for b in r["batches"][: len(r["batches"]) - r["padded"]] for i in b)
        assert max(own.values(), default=1) == 1, f"{chain}: twice, not counted as padding"
        if not opts["even_batches"]:
            assert all(r["padded"] == 0 for results in shapes for r in results)
    if not opts["even_batches"]:
        twice = sorted(i for i, c in everything.items() if c > 1)
        assert not twice, f"{chain}: more than once {twice}"
    for results in shapes if opts["even_batches"] else ():
        assert len({len(r["batches"]) for r in results}) == 1, f"{chain}: out of step"
