"""Exact resume (issue 10): interrupt anywhere, resume, interrupt again, resume again; the
batches seen equal one uninterrupted run, batch for batch."""

from __future__ import annotations

import asyncio
import json
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from resume_sources import AsyncReader, Items, StatefulReader, Stream, SyncReader
from torch.utils.data import BatchSampler, DistributedSampler

import aioloader

Make = Callable[[], aioloader.DataLoader]
EPOCHS = 2


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["i"].tolist()]


def _iterate(loader: aioloader.DataLoader, face: str) -> Any:
    if face == "sync":
        yield from loader
        return

    async def collect() -> list[Any]:
        return [b async for b in loader]

    # The async face, consumed whole per epoch but in a loop that lives across epochs.
    yield from asyncio.run(collect())


def run(make: Make, face: str, cuts: set[int] = frozenset(),  # type: ignore[assignment]
        epochs: int = EPOCHS,
        hook: Callable[[aioloader.DataLoader, int], None] | None = None) -> list[Any]:
    """Batches seen over ``epochs`` epochs, as (epoch, ids); after the n-th batch for n in
    ``cuts`` the loader's state goes through JSON into a fresh loader (0: before any)."""
    seen: list[Any] = []
    loader = make()
    if 0 in cuts:
        loader = _resumed(loader, make)
    count, epoch = 0, 0
    try:
        while epoch < epochs:
            if hook is not None:
                hook(loader, epoch)
            cut = False
            if face == "sync":
                for batch in loader:
                    seen.append((epoch, ids(batch)))
                    count += 1
                    if count in cuts:
                        loader, cut = _resumed(loader, make), True
                        break
            else:
                loader, cut, count = asyncio.run(_async_epoch(loader, make, seen, epoch,
                                                              count, cuts))
            if not cut:
                epoch += 1
    finally:
        loader.close()
    return seen


async def _async_epoch(loader: aioloader.DataLoader, make: Make, seen: list[Any], epoch: int,
                       count: int, cuts: set[int]) -> tuple[aioloader.DataLoader, bool, int]:
    async for batch in loader:
        seen.append((epoch, ids(batch)))
        count += 1
        if count in cuts:
            state = json.loads(json.dumps(loader.state_dict()))
            await loader.aclose()
            fresh = make()
            fresh.load_state_dict(state)
            return fresh, True, count
    return loader, False, count


def _resumed(loader: aioloader.DataLoader, make: Make) -> aioloader.DataLoader:
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint is JSON
    loader.close()
    fresh = make()
    fresh.load_state_dict(state)
    return fresh


def cut_points(total: int, per_epoch: int, seed: int) -> list[set[int]]:
    """Pairs of interruptions: random ones, at 0, at the last batch, at an epoch's end."""
    rng = random.Random(seed)
    pairs = [{0, per_epoch}, {per_epoch - 1, total}, {1, per_epoch + 1}]
    for _ in range(2):
        a, b = sorted(rng.sample(range(1, total + 1), 2))
        pairs.append({a, b})
    return pairs


def check(make: Make, face: str = "sync", seed: int = 0, cuts: list[set[int]] | None = None,
          **kw: Any) -> None:
    whole = run(make, face, **kw)
    assert whole, "the uninterrupted run saw no batch"
    per_epoch = sum(1 for e, _ in whole if e == 0)
    for pair in cuts or cut_points(len(whole), per_epoch, seed):
        got = run(make, face, pair, **kw)
        assert got == whole, f"interrupted at {sorted(pair)}"


# ------------------------------------------------------------------ map-style


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style(num_workers: int, shuffle: bool) -> None:
    check(lambda: aioloader.DataLoader(Items(37), batch_size=4, shuffle=shuffle, seed=3,
                                       num_workers=num_workers, quiet=True))


def test_map_style_batches_are_the_same_for_0_1_and_2_workers() -> None:
    runs = [run(lambda n=n: aioloader.DataLoader(Items(37), batch_size=4, shuffle=True, seed=3,  # type: ignore[misc]
                                                 num_workers=n, quiet=True), "sync")
            for n in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2]


def test_map_style_async_face_and_spawn() -> None:
    check(lambda: aioloader.DataLoader(Items(29), batch_size=3, shuffle=True, seed=1,
                                       num_workers=2, start_method="spawn", quiet=True),
          face="async", cuts=[{3, 10}])


def test_map_style_with_a_users_sampler_and_set_epoch() -> None:
    ds = Items(30)

    def make() -> aioloader.DataLoader:
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4)
        return aioloader.DataLoader(ds, batch_sampler=BatchSampler(sampler, 4, False),
                                    num_workers=2, quiet=True)

    def set_epoch(loader: aioloader.DataLoader, epoch: int) -> None:
        loader.batch_sampler.sampler.set_epoch(epoch)

    check(make, hook=set_epoch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_bucket_batch_sampler(num_workers: int) -> None:
    check(lambda: aioloader.DataLoader(
        Items(40), batch_sampler=aioloader.BucketBatchSampler(4, sorting_keys=["tokens"]),
        num_workers=num_workers, seed=2, quiet=True), face="async")


def test_loader_set_epoch_agrees_with_the_state() -> None:
    def hook(loader: aioloader.DataLoader, epoch: int) -> None:
        loader.set_epoch(epoch)

    check(lambda: aioloader.DataLoader(Items(21), batch_size=4, shuffle=True, seed=8,
                                       quiet=True), hook=hook)


def test_batches_per_epoch_over_map_style() -> None:
    check(lambda: aioloader.DataLoader(Items(22), batch_size=4, shuffle=True, seed=5,
                                       batches_per_epoch=4, num_workers=2, quiet=True),
          epochs=4)


def test_resuming_a_map_style_epoch_fetches_no_skipped_sample() -> None:
    ds = Items(100_000)
    loader = aioloader.DataLoader(ds, batch_size=10, shuffle=True, seed=0, quiet=True)
    state = loader.state_dict()
    state["batches_in_pass"] = 9_000  # as if 90 % of the epoch had been consumed
    state["batches_in_epoch"] = 9_000
    resumed = aioloader.DataLoader(ds, batch_size=10, shuffle=True, seed=0, quiet=True)
    resumed.load_state_dict(state)
    Items.calls = 0
    rest = [ids(b) for b in resumed]
    assert Items.calls == 10_000  # exactly the samples of the last 1,000 batches
    full = [ids(b) for b in aioloader.DataLoader(ds, batch_size=10, shuffle=True, seed=0,
                                                 quiet=True)]
    assert rest == full[9_000:]


# ------------------------------------------------------------------ readers


READERS = {"sync": SyncReader, "async": AsyncReader, "stateful": StatefulReader}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("lazy", [False, True])
def test_readers(reader: str, num_workers: int, lazy: bool) -> None:
    cls = READERS[reader]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aioloader.ResumeWarning)
        check(lambda: aioloader.DataLoader(
            cls(41), batch_size=4, shuffle=True, seed=6, num_workers=num_workers,
            max_instances_in_memory=10 if lazy else None, quiet=True), seed=num_workers)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_lazy_reader_without_shuffle_async_face(num_workers: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aioloader.ResumeWarning)
        check(lambda: aioloader.DataLoader(
            AsyncReader(33), batch_size=4, num_workers=num_workers, drop_last=True,
            max_instances_in_memory=8, quiet=True), face="async")


def test_lazy_reader_bucket_batch_sampler_spawn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aioloader.ResumeWarning)
        check(lambda: aioloader.DataLoader(
            SyncReader(45), batch_sampler=aioloader.BucketBatchSampler(4, ["tokens"]), seed=9,
            num_workers=2, start_method="spawn", max_instances_in_memory=12, quiet=True),
            cuts=[{0, 12}, {5, 17}])


def test_lazy_stream_with_batches_per_epoch() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aioloader.ResumeWarning)
        check(lambda: aioloader.DataLoader(
            SyncReader(30), batch_size=4, shuffle=True, seed=2, num_workers=2,
            max_instances_in_memory=8, batches_per_epoch=5, quiet=True), epochs=4)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset(lazy: bool, num_workers: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aioloader.ResumeWarning)
        check(lambda: aioloader.DataLoader(
            Stream(26), batch_size=3, shuffle=True, seed=4, num_workers=num_workers,
            max_instances_in_memory=6 if lazy else None, quiet=True), face="async")


def test_a_stateful_reader_resumes_where_it_stood_and_without_warning() -> None:
    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(StatefulReader(50), batch_size=5, shuffle=True, seed=1,
                                    max_instances_in_memory=10, quiet=True)

    loader = make()
    it = iter(loader)
    for _ in range(5):  # 25 instances: block 2 (of 10 instances) is half delivered
        next(it)
    state = loader.state_dict()
    loader.close()
    StatefulReader.started_at.clear()
    fresh = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
        list(fresh)
    assert StatefulReader.started_at == [20]  # the start of the block, not of the data


def test_a_reader_without_state_is_skipped_ahead_with_one_warning() -> None:
    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(SyncReader(50), batch_size=5, max_instances_in_memory=10,
                                    quiet=True)

    loader = make()
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    loader.close()
    fresh = make()
    with pytest.warns(aioloader.ResumeWarning, match="skipping 30 instances"):
        fresh.load_state_dict(state)
    assert [ids(b) for b in fresh] == [[i, i + 1, i + 2, i + 3, i + 4]
                                       for i in range(35, 50, 5)]


# ------------------------------------------------------------------ bad input


def _map_loader(**kw: Any) -> aioloader.DataLoader:
    options: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=3, quiet=True)
    return aioloader.DataLoader(Items(20), **(options | kw))


def test_a_state_from_other_arguments_names_the_difference() -> None:
    loader = _map_loader()
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    with pytest.raises(aioloader.ResumeError, match="batch_size=4 when the state was taken, 8"):
        _map_loader(batch_size=8).load_state_dict(state)
    with pytest.raises(aioloader.ResumeError, match="seed=3 when the state was taken, 4"):
        _map_loader(seed=4).load_state_dict(state)
    with pytest.raises(aioloader.ResumeError, match="dataset_len=20"):
        aioloader.DataLoader(Items(21), batch_size=4, shuffle=True, seed=3,
                             quiet=True).load_state_dict(state)


@pytest.mark.parametrize("bad", [
    None, [], {"foo": 1}, {"format": "torchdata"},
    "corrupt-pass", "corrupt-stream", "negative", "version",
])
def test_a_corrupt_or_foreign_state_is_refused_and_the_loader_stays_usable(bad: Any) -> None:
    loader = _map_loader()
    good = loader.state_dict()
    state: Any = bad
    if bad == "corrupt-pass":
        state = good | {"pass": "one"}
    elif bad == "corrupt-stream":
        state = good | {"stream": {"shards": "?"}}
    elif bad == "negative":
        state = good | {"batches_in_pass": -3}
    elif bad == "version":
        state = good | {"version": 99}
    with pytest.raises(aioloader.ResumeError):
        loader.load_state_dict(state)
    assert sum(len(ids(b)) for b in loader) == 20


def test_a_position_past_the_epoch_is_refused_when_the_epoch_starts() -> None:
    loader = _map_loader()
    state = loader.state_dict() | {"batches_in_pass": 99}
    loader.load_state_dict(state)
    with pytest.raises(aioloader.ResumeError, match="99 batches of epoch 0"):
        list(loader)
    assert sum(len(ids(b)) for b in loader) == 20  # usable afterwards


def test_load_state_dict_during_an_epoch_is_refused() -> None:
    loader = _map_loader()
    it = iter(loader)
    next(it)
    with pytest.raises(aioloader.LoaderBusyError):
        loader.load_state_dict(loader.state_dict())
    assert len(list(it)) == 4
    loader.close()


def test_the_state_is_small_json_and_takes_the_seed_of_the_run() -> None:
    loader = aioloader.DataLoader(Items(20), batch_size=4, shuffle=True, quiet=True)  # seed=None
    it = iter(loader)
    first = [ids(next(it)) for _ in range(2)]
    state = loader.state_dict()
    rest = [ids(b) for b in it]
    assert len(json.dumps(state)) < 1000
    fresh = aioloader.DataLoader(Items(20), batch_size=4, shuffle=True, quiet=True)
    fresh.load_state_dict(state)
    assert [ids(b) for b in fresh] == rest
    assert len(first + rest) == 5
    assert [ids(b) for b in fresh] == [ids(b) for b in loader]  # then both are in epoch 1
    loader.close()
    fresh.close()


# ------------------------------------------------------------------ JSON lines


@pytest.mark.parametrize("gzipped", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_json_lines_reader_resumes_from_its_offsets(tmp_path: Any, gzipped: bool,
                                                    num_workers: int) -> None:
    import gzip

    from aioloader.readers import JsonLinesReader

    n = 0
    for k, lines in enumerate((23, 17, 30)):  # 3 files: line-sharded for 2 workers
        text = "".join(json.dumps({"i": n + j, "pad": "p" * j}) + "\n" for j in range(lines))
        n += lines
        path = tmp_path / f"part{k}.jsonl{'.gz' if gzipped else ''}"
        path.write_bytes(gzip.compress(text.encode()) if gzipped else text.encode())

    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(JsonLinesReader(chunk_size=64), str(tmp_path / "part*"),
                                    batch_size=4, shuffle=True, seed=5,
                                    max_instances_in_memory=12, num_workers=num_workers,
                                    quiet=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", aioloader.ResumeWarning)  # O(1): nothing is skipped
        check(make, seed=num_workers)
    seen = sorted(i for _, batch in run(make, "sync", epochs=1) for i in batch)
    assert seen == list(range(n))


# ------------------------------------------------------------------ torch.distributed


@pytest.mark.deadline(300)
def test_each_rank_resumes_its_own_shard_exactly(tmp_path: Any) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts_issue9"))
    import issue9_dist
    import resume_dist

    ranks = issue9_dist.run_ranks(tmp_path, list(resume_dist.CASES), deadline=240,
                                  registry="resume_dist")
    for name in resume_dist.CASES:
        per_rank = [ranks[r][name] for r in (0, 1)]
        for r, got in enumerate(per_rank):
            assert "error" not in got, f"rank {r}, {name}: {got['error']}"
            assert got["whole"], f"rank {r}, {name}: no batch"
            for resumed in got["resumed"]:
                assert resumed == got["whole"], f"rank {r}, {name}"
        if name != "stream_batches_per_epoch":  # the ranks share the data between them
            seen = [i for got in per_rank for e, b in got["whole"] if e == 0 for i in b]
            assert set(seen) == set(range(37 if name == "map_style" else 41)), name


# ------------------------------------------------------------------ len()-driven consumers


@pytest.mark.parametrize("num_workers", [0, 2])
def test_taking_len_batches_then_iterating_again_starts_the_next_epoch(num_workers: int) -> None:
    """Lightning, zip() and islice() take len(loader) batches and never ask for the end:
    that epoch is over all the same (it used to be replayed, shuffle and all)."""
    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(Items(30), batch_size=4, shuffle=True, seed=3,
                                    num_workers=num_workers, quiet=True)

    reference = make()
    whole = [[ids(b) for b in reference] for _ in range(3)]
    reference.close()
    loader = make()
    n = len(loader)
    kept = iter(loader)  # still referenced when the next epoch starts
    epochs = [[ids(next(kept)) for _ in range(n)]]
    epochs += [[ids(b) for b, _ in zip(loader, range(n), strict=False)] for _ in range(2)]
    assert epochs == whole
    loader.close()


@pytest.mark.deadline(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_before_iterating_a_resumed_stream_is_the_resumed_one(
        workers: int) -> None:
    """state_dict() right after load_state_dict() (a checkpoint before the first step, or
    a job preempted again at once) holds the stream's position: it held none, and a resume
    from it read the pass again from its start (found by issue 33's chains of shapes)."""
    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(SyncReader(41), batch_size=3, shuffle=True, seed=2,
                                    num_workers=workers, max_instances_in_memory=6,
                                    quiet=True)

    with make() as loader:
        whole = [[int(i) for i in b["i"]] for b in loader]
    with make() as loader:
        batches = iter(loader)
        first = [[int(i) for i in next(batches)["i"]] for _ in range(4)]
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        again = loader.state_dict()
    assert again["stream"] == state["stream"]
    with make() as loader:
        loader.load_state_dict(again)
        rest = [[int(i) for i in b["i"]] for b in loader]
    assert first + rest == whole
