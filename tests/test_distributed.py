"""torch.distributed: ranks x workers cover the data exactly once; even batches per rank."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import dist_helpers

N = 40
CASES = ["reader_cached", "reader_lazy", "map_style", "map_style_shuffled", "iterable"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict]]:
    out = tmp_path_factory.mktemp("ranks")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=dist_helpers.rank_main, args=(r, 2, port, str(out), N))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


@pytest.mark.parametrize("case", CASES)
def test_ranks_times_workers_see_every_instance_once(two_ranks, case):
    seen = two_ranks[0][case]["indices"] + two_ranks[1][case]["indices"]
    assert sorted(seen) == list(range(N)), f"{case}: {sorted(seen)}"


@pytest.mark.parametrize("case", CASES)
def test_even_batches_give_every_rank_the_same_number(two_ranks, case):
    assert two_ranks[0][case]["batches"] == two_ranks[1][case]["batches"]
