"""Issue 21's evidence, completed by an audit: what the other reshape tests leave out.

2 gloo ranks (2 workers each) take 4 batches of epoch 0 and save their states; then:

* 2 -> 1 rank (in this process, no process group: a debug resume) with 0 and 2 workers, and
  2 -> 4 gloo ranks (1 worker each): every instance exactly once (no padding on one rank,
  no more than ``even_batches``' on four), for map-style, cached and lazy readers and a
  load stage, ordered or not; map-style in the epoch's global order, dealt ``left[r::R']``;
* a state taken inside the resumed pass resumes once more on a third shape (a lazy stream
  too, and ``ordered=False``, on as many new shapes as it is taken);
* restarts (a worker SIGKILLed), recycling and the load stage's skips after such a resume;
* what is refused, and says so: an IterableDataset that splits itself, a batch_sampler of
  the user's own, and lists of states that are not every rank's at one step;
* a cached source that splits itself (contiguous ranges) is refused on other workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import os
import select
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset

import aioloader

sys.path.insert(0, str(Path(__file__).parent / "scripts_issue9"))

from issue9_sources import SplitByNodeAndWorker
from reshape_dist import save_states
from resume_sources import Items, SyncReader, item

TAKEN = 4  # batches each of the 2 ranks delivers before its checkpoint
N = {"map": 201, "cached": 200, "lazy": 200, "loaded": 200, "unordered": 200, "iter_cached": 41,
     "iter_lazy": 41, "own_sampler": 37}
RESUMABLE = ["map", "cached", "lazy", "loaded", "unordered"]


def collate(items: list[dict[str, Any]]) -> Any:
    """The default collate, with the pid of the process that built the batch."""
    return aioloader.default_collate([dict(it, pid=os.getpid()) for it in items])


class Keys(aioloader.Reader):
    """Keys 0..n-1, loaded by the load stage; a key's load takes a few turns of the loop (so
    with ordered=False later keys finish first); key ``bad`` fails."""

    def __init__(self, n: int, bad: int | None = None) -> None:
        self.n, self.bad = n, bad

    def read(self, data_path: Any) -> Any:
        yield from range(self.n)

    async def load(self, key: int) -> dict[str, Any]:
        for _ in range((key * 7919) % 7):
            await asyncio.sleep(0)
        if key == self.bad:
            raise ValueError(f"a bad record: {key}")
        return item(key)


class RankSplit(SplitByNodeAndWorker):
    """Splits itself by rank and by worker (datasets.split_dataset_by_node's way)."""

    def __iter__(self) -> Any:
        return iter(item(i) for i in self.indices())


class Ranges(IterableDataset[dict[str, Any]]):
    """Splits itself across workers in contiguous ranges, as torch's IterableDataset docs
    show (``per_worker = ceil(n / num_workers)``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        lo, hi = 0, self.n
        if info is not None:
            per = math.ceil(self.n / info.num_workers)
            lo, hi = info.id * per, min(info.id * per + per, self.n)
        return iter(item(i) for i in range(lo, hi))


def make(kind: str, workers: int, bad: int | None = None, **extra: Any) -> aioloader.DataLoader:
    common: dict[str, Any] = dict(batch_size=3, shuffle=True, seed=2, num_workers=workers,
                                  collate_fn=collate, quiet=True, **extra)
    n = N[kind]
    if kind == "map":
        return aioloader.DataLoader(Items(n), **common)
    if kind == "cached":
        return aioloader.DataLoader(SyncReader(n), **common)
    if kind == "lazy":
        return aioloader.DataLoader(SyncReader(n), max_instances_in_memory=6, **common)
    if kind in ("loaded", "unordered"):  # a load stage, ordered or not
        keys = Keys(n, bad)
        return aioloader.DataLoader(keys, max_instances_in_memory=8, load_fn=keys.load,
                                    concurrency=4, ordered=kind == "loaded", **common)
    if kind == "iter_cached":
        return aioloader.DataLoader(RankSplit(n), **common)
    if kind == "iter_lazy":
        return aioloader.DataLoader(RankSplit(n), max_instances_in_memory=6, **common)
    assert kind == "own_sampler"
    data = Items(n)
    import torch.distributed as dist

    replicas = {} if dist.is_available() and dist.is_initialized() else {"num_replicas": 1,
                                                                        "rank": 0}
    return aioloader.DataLoader(
        data, batch_sampler=BatchSampler(DistributedSampler(data, shuffle=False, **replicas),
                                         3, False),
        num_workers=workers, collate_fn=collate, quiet=True, **extra)


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["i"]]


def _dir() -> Path:
    return Path(os.environ["RESHAPE_GAPS_DIR"])


# ------------------------------------------------------------------ on each gloo rank


def case_save(rank: int, world: int) -> dict[str, Any]:
    return save_states({kind: functools.partial(make, kind, 2) for kind in N}, _dir(), rank,
                       TAKEN)


def case_resume4(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in [*RESUMABLE, "iter_cached", "iter_lazy"]:
        loader = make(kind, 1)
        try:
            try:
                loader.load_state_dict(_states(kind))
            except aioloader.ResumeError as exc:
                out[kind] = {"refused": str(exc)}
                continue
            rest = [ids(b) for b in loader]
            padded = loader.stats().padded  # (even_batches: the repeats end the pass)
            next_epoch = [ids(b) for b in loader]
        finally:
            loader.close()
        with make(kind, 1) as fresh:
            fresh.set_epoch(1)
            whole_next = [ids(b) for b in fresh]
        out[kind] = {"rest": rest, "next": next_epoch, "whole_next": whole_next,
                     "padded": padded}
    return out


CASES = {"save": case_save, "resume4": case_resume4}


# ------------------------------------------------------------------ in the test process


def _states(kind: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(_dir().glob(f"{kind}-rank*.json"))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    """Every kind's state on 2 gloo ranks (2 workers each) after 4 batches; what each rank
    delivered. ``$RESHAPE_GAPS_DIR`` names the folder of the states for the module."""
    import issue9_dist

    tmp = tmp_path_factory.mktemp("reshape-gaps")
    shared = tmp / "states"
    shared.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RESHAPE_GAPS_DIR", str(shared))
        out = tmp / "save"
        out.mkdir()
        ranks = issue9_dist.run_ranks(out, ["save"], deadline=240, world=2,
                                      registry="test_reshape_gaps")
        for r, got in ranks.items():
            assert "error" not in got["save"], f"rank {r}: {got['save']['error']}"
        yield ranks


def _taken(saved: dict[int, Any], kind: str) -> list[int]:
    return [i for r in (0, 1) for b in saved[r]["save"][kind]["taken"] for i in b]


def _global_order() -> list[int]:
    """Epoch 0 of the map-style loader on one rank: the epoch's global order."""
    with make("map", 0) as loader:
        return [i for b in loader for i in ids(b)]


def _exactly_once(seen: list[int], n: int, what: str) -> None:
    counts = collections.Counter(seen)
    missing = sorted(set(range(n)) - set(counts))
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert not missing and not twice, f"{what}: missing {missing}, more than once {twice}"


@pytest.mark.deadline(300)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", RESUMABLE)
def test_two_ranks_to_one_every_instance_exactly_once(saved: dict[int, Any], kind: str,
                                                      workers: int) -> None:
    """No padding on one rank: exactly once, not 'at least once'; map-style goes on in the
    epoch's global order; the next epoch is one rank's own; the states are small."""
    taken = _taken(saved, kind)
    with make(kind, workers) as loader:
        loader.load_state_dict(_states(kind))
        rest = [ids(b) for b in loader]
        next_epoch = [ids(b) for b in loader]
    _exactly_once(taken + [i for b in rest for i in b], N[kind], kind)
    if kind == "map":
        order = _global_order()
        assert [i for b in rest for i in b] == [i for i in order if i not in set(taken)]
    with make(kind, workers) as fresh:
        fresh.set_epoch(1)
        whole_next = [ids(b) for b in fresh]
    if kind == "unordered":  # loads finish out of order: the keys, not the batches
        _exactly_once([i for b in next_epoch for i in b], N[kind], f"{kind}, epoch 1")
    else:
        assert next_epoch == whole_next
    for r in (0, 1):
        assert saved[r]["save"][kind]["bytes"] < 1024, saved[r]["save"][kind]["bytes"]


@pytest.mark.deadline(300)
def test_two_ranks_to_four_gloo_ranks_exactly_once_but_padding(
        saved: dict[int, Any], tmp_path: Path) -> None:
    import issue9_dist

    ranks = issue9_dist.run_ranks(tmp_path, ["resume4"], deadline=240, world=4,
                                  registry="test_reshape_gaps")
    for r, got in ranks.items():
        assert "error" not in got["resume4"], f"rank {r}: {got['resume4']['error']}"
    after = {r: ranks[r]["resume4"] for r in range(4)}
    order = _global_order()
    for kind in RESUMABLE:
        taken = _taken(saved, kind)
        parts = [[i for b in after[r][kind]["rest"] for i in b] for r in range(4)]
        rest = [i for p in parts for i in p]
        left = N[kind] - len(set(taken))
        if kind == "map":  # the rest of the global order, dealt r::4, padded as
            pending = [i for i in order if i not in set(taken)]  # DistributedSampler pads
            for r, part in enumerate(parts):
                assert part[: len(pending[r::4])] == pending[r::4], f"rank {r}"
            assert len(rest) - left == (-left) % 4
            assert set(rest) == set(pending)
        elif kind == "cached":  # each rank's cache is its own; the ranks agree on a count
            assert set(taken) | set(rest) == set(range(N[kind]))
            assert not set(taken) & set(rest), "an instance delivered before came again"
            assert len({len(after[r][kind]["rest"]) for r in range(4)}) == 1
            assert len(rest) - left < 4 * 3  # at most a batch of padding per rank
        else:  # a stream's rank that ends first repeats batches: the rest exactly once
            own = [i for r in range(4) for b in after[r][kind]["rest"][
                : len(after[r][kind]["rest"]) - after[r][kind]["padded"]] for i in b]
            _exactly_once(taken + own, N[kind], kind)
            assert len({len(after[r][kind]["rest"]) for r in range(4)}) == 1
        for r in range(4):
            got = after[r][kind]
            if kind == "unordered":  # loads finish out of order: the keys, not the batches
                assert collections.Counter(i for b in got["next"] for i in b) == (
                    collections.Counter(i for b in got["whole_next"] for i in b))
            else:
                assert got["next"] == got["whole_next"], f"{kind}, rank {r}: epoch 1"
    for kind in ("iter_cached", "iter_lazy"):  # refused on every rank, saying why
        for r in range(4):
            assert "splits itself between the" in after[r][kind].get("refused", ""), (
                kind, r, after[r][kind])


@pytest.mark.deadline(300)
@pytest.mark.parametrize(("kind", "third"), [("map", 3), ("map", 0), ("cached", 3),
                                             ("cached", 0), ("lazy", 3), ("lazy", 0)])
def test_a_state_inside_a_pass_resumed_from_two_ranks_resumes_on_a_third_shape(
        saved: dict[int, Any], kind: str, third: int) -> None:
    """2 ranks x 2 workers -> 1 rank x 1 worker (2 batches, a state) -> 1 rank x ``third``."""
    taken = _taken(saved, kind)
    with make(kind, 1) as loader:
        loader.load_state_dict(_states(kind))
        batches = iter(loader)
        middle = [i for _ in range(2) for i in ids(next(batches))]
        inside = json.loads(json.dumps(loader.state_dict()))
    assert len(json.dumps(inside)) < 2048
    with make(kind, third) as again:
        again.load_state_dict(inside)
        rest = [i for b in again for i in ids(b)]
    _exactly_once(taken + middle + rest, N[kind], kind)
    if kind == "map":
        assert middle + rest == [i for i in _global_order() if i not in set(taken)]


@pytest.mark.deadline(300)
def test_ordered_false_resumed_from_two_ranks_resumes_on_every_new_shape(
        saved: dict[int, Any]) -> None:
    """With ordered=False a pass changes shape as often as it is taken (issue 33; it was
    refused after the first change): 2 ranks x 2 workers -> 1 rank x 1 worker -> 1 x 3 ->
    1 x 0, two batches and a state on each, then the rest: every key exactly once, and each
    state bounded by what was in flight (a level of positions per shape, not the keys)."""
    taken = _taken(saved, "unordered")
    states = _states("unordered")
    seen, sizes = list(taken), []
    for workers in (1, 3):
        with make("unordered", workers) as loader:
            loader.load_state_dict(states)
            batches = iter(loader)
            seen += [i for _ in range(2) for i in ids(next(batches))]
            states = [json.loads(json.dumps(loader.state_dict()))]
        sizes.append(len(json.dumps(states[0])))
    with make("unordered", 0) as again:
        again.load_state_dict(states)
        seen += [i for b in again for i in ids(b)]
    _exactly_once(seen, N["unordered"], "unordered")
    assert sizes[0] < 2048 and sizes[1] < 4096, sizes
    with make("unordered", 1) as same:  # the same shape as a state's: exact, as before
        same.load_state_dict(states)
        assert len([b for b in same]) > 0


def _wait_dead(pid: int) -> None:
    """Wait for ``pid`` to exit, on a pidfd (not reaping it: its parent does)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 60)[0], f"pid {pid} still alive"
    finally:
        os.close(fd)


@pytest.mark.deadline(300)
@pytest.mark.parametrize("kind", RESUMABLE)
def test_a_worker_killed_after_two_ranks_to_one_heals(saved: dict[int, Any],
                                                      kind: str) -> None:
    taken = _taken(saved, kind)
    rest: list[int] = []
    with make(kind, 2, max_worker_restarts=1) as loader:
        loader.load_state_dict(_states(kind))
        for n, batch in enumerate(loader):
            rest += ids(batch)
            if n == 3:
                pid = int(batch["pid"][0])
                os.kill(pid, signal.SIGKILL)
                _wait_dead(pid)
        restarts = loader.stats().restarts
    assert restarts == 1
    _exactly_once(taken + rest, N[kind], kind)
    if kind == "map":
        assert rest == [i for i in _global_order() if i not in set(taken)]


@pytest.mark.deadline(300)
@pytest.mark.parametrize("kind", ["map", "cached", "lazy", "loaded"])
def test_recycled_workers_after_two_ranks_to_one(saved: dict[int, Any], kind: str) -> None:
    """(ordered=False refuses max_batches_per_worker when the loader is built.)"""
    taken = _taken(saved, kind)
    with make(kind, 2, max_batches_per_worker=2) as loader:
        loader.load_state_dict(_states(kind))
        rest = [i for b in loader for i in ids(b)]
        recycles = loader.stats().recycles
    assert recycles > 0
    _exactly_once(taken + rest, N[kind], kind)
    if kind == "map":
        assert rest == [i for i in _global_order() if i not in set(taken)]


@contextlib.contextmanager
def _quiet_log() -> Iterator[None]:
    log = logging.getLogger("aioloader")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


@pytest.mark.deadline(300)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["loaded", "unordered"])
def test_a_key_skipped_on_error_after_two_ranks_to_one(saved: dict[int, Any], kind: str,
                                                       workers: int) -> None:
    """A load stage: the last key fails after the resume, is skipped and counted; every
    other key is seen exactly once."""
    taken = _taken(saved, kind)
    bad = N[kind] - 1
    assert bad not in taken
    with _quiet_log(), make(kind, workers, bad=bad, on_error="skip") as loader:
        loader.load_state_dict(_states(kind))
        rest = [i for b in loader for i in ids(b)]
        skipped = {s.key for s in loader.skipped}
    # (the workers' read-ahead into the next pass may report the key again)
    assert skipped == {bad} and bad not in rest
    _exactly_once(taken + rest + [bad], N[kind], kind)


@pytest.mark.deadline(120)
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 0)])
def test_a_key_skipped_on_error_after_a_resume_with_other_workers(
        ordered: bool, before: int, after: int) -> None:
    n, bad = 60, 55

    def loader_of(workers: int, failing: int | None) -> aioloader.DataLoader:
        keys = Keys(n, failing)
        return aioloader.DataLoader(keys, batch_size=3, shuffle=True, seed=2,
                                    num_workers=workers, max_instances_in_memory=8,
                                    load_fn=keys.load, concurrency=4, ordered=ordered,
                                    on_error="skip", quiet=True)

    with loader_of(before, None) as loader:
        batches = iter(loader)
        first = [i for _ in range(4) for i in ids(next(batches))]
        state = json.loads(json.dumps(loader.state_dict()))
    assert bad not in first
    with _quiet_log(), loader_of(after, bad) as loader:
        loader.load_state_dict(state)
        rest = [i for b in loader for i in ids(b)]
        skipped = {s.key for s in loader.skipped}
    assert skipped == {bad} and bad not in rest
    _exactly_once(first + rest + [bad], n, f"ordered={ordered}")


@pytest.mark.deadline(300)
@pytest.mark.parametrize(("kind", "why"), [
    ("iter_cached", "splits itself between the workers or ranks"),
    ("iter_lazy", "splits itself between the workers or ranks"),
    ("own_sampler", "a batch_sampler of your own"),
])
def test_on_another_world_size_refused_saying_why(saved: dict[int, Any], kind: str,
                                                  why: str) -> None:
    loader = make(kind, 0)
    try:
        with pytest.raises(aioloader.ResumeError, match=why) as caught:
            loader.load_state_dict(_states(kind))
        assert "resume on" in str(caught.value)  # what to do
        assert "rank 0 of 2" in str(caught.value)  # the shape it was taken on
        assert sorted(i for b in loader for i in ids(b)) == list(range(N[kind]))  # usable
    finally:
        loader.close()


@pytest.mark.deadline(300)
@pytest.mark.parametrize("kind", ["map", "lazy"])
def test_a_list_of_states_that_is_not_every_ranks_at_one_step_is_refused(
        saved: dict[int, Any], kind: str) -> None:
    s0, s1 = _states(kind)
    other = "lazy" if kind == "map" else "map"
    truncated = {k: v for k, v in s1.items() if k != "batches_in_pass"}
    cases: list[tuple[Any, str]] = [
        ([s0], r"rank\(s\) \[1\] of 2 are missing"),
        ([s1, s1], "two of these states are of the same rank"),
        ([s0, s1 | {"pass": s1["pass"] + 1}], "not of one run at one step"),
        ([s0, s1 | {"seed": s1["seed"] + 1}], "seed=3 when the state was taken, 2 here"),
        ([s0, truncated], "corrupt aioloader state dict.*cut short"),
        ([s0, _states(other)[1]], "other arguments"),
        ([s0, {"format": "torchdata"}], "not an aioloader DataLoader state dict"),
        ([s0, s1 | {"loader": s1["loader"] | {"rank": 5}}], "rank 5 of world_size 2"),
    ]
    loader = make(kind, 0)
    try:
        for states, message in cases:
            with pytest.raises(aioloader.ResumeError, match=message):
                loader.load_state_dict(states)
        assert sorted(i for b in loader for i in ids(b)) == list(range(N[kind]))  # usable
        loader.load_state_dict([s1, s0])  # the order of the list does not matter
        rest = [i for b in loader for i in ids(b)]
    finally:
        loader.close()
    _exactly_once(_taken(saved, kind) + rest, N[kind], kind)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (2, 0)])
def test_a_cached_source_that_splits_itself_is_refused_on_other_workers(
        before: int, after: int) -> None:
    """Split in contiguous ranges (torch's docs), its workers' instances come back in
    another order on another num_workers: the state is refused, saying what to do, and the
    same num_workers resumes it exactly."""
    n = 31

    def loader_of(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(Ranges(n), batch_size=3, shuffle=True, seed=6,
                                    num_workers=workers, quiet=True)

    with loader_of(before) as loader:
        batches = iter(loader)
        first = [i for _ in range(4) for i in ids(next(batches))]
        state = json.loads(json.dumps(loader.state_dict()))
    with loader_of(after) as loader, pytest.raises(aioloader.ResumeError) as caught:
        loader.load_state_dict(state)
    assert "splits itself" in str(caught.value) and "num_workers" in str(caught.value)
    with loader_of(before) as loader:
        loader.load_state_dict(state)
        rest = [i for b in loader for i in ids(b)]
    _exactly_once(first + rest, n, f"{before} -> {before} workers")
