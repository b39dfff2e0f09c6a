"""The load stage (issue 11): keys in, instances out, up to ``concurrency`` loads in flight
per process; retries for transient errors; ``on_error="skip"`` reports; cancellation."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from load_sources import (
    AsyncItems,
    AsyncKeys,
    Hang,
    Keys,
    KeyStream,
    Names,
    load_name,
    load_name_blocking,
)

import aioloader
from aioloader import LoadError, Retry, WorkerError


class Plain(aioloader.Reader):
    """The instances the keys load to, read directly: the reference."""

    def read(self, n: int) -> Any:
        yield from ({"k": i} for i in range(n))


def keys_of(loader: aioloader.DataLoader) -> list[list[int]]:
    return [b["k"].tolist() for b in loader]


WORKERS = [0, 1, 2]


@pytest.mark.deadline(180)
@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("lazy", [None, 16])
@pytest.mark.parametrize("reader", [Keys, AsyncKeys])
def test_loaded_batches_equal_the_instances_read_directly(
        num_workers: int, lazy: int | None, reader: type[Keys]) -> None:
    """In key order, the load stage changes nothing but where the instances come from:
    the batches (shuffle and sharding included) equal a reader of the loaded instances."""
    opts: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=3, num_workers=num_workers,
                                max_instances_in_memory=lazy, quiet=True)
    want = keys_of(aioloader.DataLoader(Plain(), 101, **opts))
    got = keys_of(aioloader.DataLoader(reader(delay=0.001), 101, concurrency=8, **opts))
    assert got == want
    assert sorted(k for b in got for k in b) == list(range(101))


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loads_overlap_up_to_concurrency_per_process(num_workers: int) -> None:
    loader = aioloader.DataLoader(Keys(delay=0.01), 200, batch_size=10,
                                  num_workers=num_workers, concurrency=16, quiet=True)
    peaks: dict[int, int] = {}
    for batch in loader:
        for pid, peak in zip(batch["pid"].tolist(), batch["peak"].tolist(), strict=True):
            peaks[pid] = max(peaks.get(pid, 0), peak)
    assert len(peaks) == max(num_workers, 1)
    assert all(peak == 16 for peak in peaks.values()), peaks  # never more, and it fills


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_async_getitem_and_keyed_load_fn(num_workers: int) -> None:
    plain = [b.tolist() for b in aioloader.DataLoader(list(range(50)), batch_size=4,
                                                         shuffle=True, seed=1, quiet=True)]
    for loader in (
            aioloader.DataLoader(AsyncItems(50), batch_size=4, shuffle=True, seed=1,
                                 num_workers=num_workers, concurrency=8, quiet=True),
            aioloader.DataLoader(Names(50), batch_size=4, shuffle=True, seed=1,
                                 num_workers=num_workers, load_fn=load_name, quiet=True),
    ):
        assert keys_of(loader) == plain  # the sampler's order, loads overlapped or not


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_blocking_load_fn_runs_in_threads(num_workers: int) -> None:
    loader = aioloader.DataLoader(Names(40), batch_size=8, num_workers=num_workers,
                                  load_fn=load_name_blocking, concurrency=4, quiet=True)
    batches = list(loader)
    assert [b["k"].tolist() for b in batches] == [list(range(i, i + 8))
                                                  for i in range(0, 40, 8)]
    assert all(torch.equal(b["x"], torch.full((8, 3), 2.0)) for b in batches)


def load_without_x_at_6(name: str) -> dict[str, Any]:
    k = int(name.split("-")[1])
    return {"x": k} if k != 6 else {"y": k}


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_collate_key_error_after_a_load_names_the_dataset_index(num_workers: int) -> None:
    """Loaded items are collated with their batch's indices, as fetched ones are: the
    sample loaded from index 6 (place 2 of the second batch) lacks "x", and the error says
    so (with a load stage, no index was named before)."""
    loader = aioloader.DataLoader(Names(12), batch_size=4, num_workers=num_workers,
                                  load_fn=load_without_x_at_6, quiet=True)
    with pytest.raises(KeyError) as info:
        list(loader)
    err = info.value
    if num_workers:
        assert isinstance(err, WorkerError)
        err = err.__cause__
    assert isinstance(err, aioloader.CollateKeyError)
    assert (err.sample, err.position) == (6, 2)
    assert "sample 2 of the batch (index 6) has no key 'x'" in str(err)


@pytest.mark.deadline(120)
def test_an_iterable_dataset_of_keys_with_a_load_fn() -> None:
    want = sorted(range(30))
    loader = aioloader.DataLoader(KeyStream(30), batch_size=5, num_workers=2,
                                  load_fn=_load_int, quiet=True)
    assert sorted(k for b in keys_of(loader) for k in b) == want


async def _load_int(key: int) -> dict[str, int]:
    await asyncio.sleep(0)
    return {"k": key}


# ------------------------------------------------------------------ failures


@pytest.mark.deadline(180)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("error", [ConnectionResetError, TimeoutError])
def test_transient_failures_are_retried_and_every_key_arrives_once_in_order(
        num_workers: int, error: type[Exception]) -> None:
    fail = {k: 1 + k % 3 for k in range(0, 60, 5)}  # up to 3 failed attempts
    opts: dict[str, Any] = dict(batch_size=4, num_workers=num_workers, quiet=True)
    want = keys_of(aioloader.DataLoader(Plain(), 60, **opts))
    loader = aioloader.DataLoader(Keys(fail, error), 60, concurrency=8,
                                  retries=Retry(3, backoff=0.001), **opts)
    batches = list(loader)
    assert [b["k"].tolist() for b in batches] == want  # exactly once, in order
    attempts = {k: a for b in batches for k, a in zip(b["k"].tolist(), b["attempt"].tolist(),
                                                      strict=True)}
    assert attempts == {k: fail.get(k, 0) + 1 for k in range(60)}
    assert loader.skipped == []


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_permanent_error_is_not_retried_and_names_the_key_and_worker(
        num_workers: int) -> None:
    loader = aioloader.DataLoader(Keys({7: 99}, KeyError), 20, batch_size=4,
                                  num_workers=num_workers, retries=5, quiet=True)
    with pytest.raises((LoadError, WorkerError)) as info:
        list(loader)
    err = info.value if isinstance(info.value, LoadError) else info.value.__cause__
    assert isinstance(err, LoadError), info.value
    assert err.key == 7 and err.attempts == 1  # KeyError is not transient
    where = "the main process" if num_workers == 0 else f"worker {7 % num_workers}"
    assert f"loading key 7 failed in {where} after 1 attempt(s)" in str(info.value)
    assert "injected failure of key 7" in str(info.value)


@pytest.mark.deadline(120)
def test_retries_give_up_after_the_budget_and_retry_on_chooses_the_errors() -> None:
    loader = aioloader.DataLoader(Keys({3: 99}), 8, batch_size=4, quiet=True,
                                  retries=Retry(2, backoff=0.001))
    with pytest.raises(LoadError, match=r"key 3 failed in the main process after 3 attempt"):
        list(loader)
    loader = aioloader.DataLoader(Keys({3: 2}, ValueError), 8, batch_size=4, quiet=True,
                                  retries=Retry(2, backoff=0.001, retry_on=(ValueError,)))
    assert keys_of(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.deadline(120)
def test_a_per_attempt_timeout_turns_a_hang_into_a_retry() -> None:
    class SlowOnce(Keys):
        async def load(self, key: int) -> dict[str, Any]:
            self._attempts[key] = self._attempts.get(key, 0) + 1
            if key == 2 and self._attempts[key] == 1:
                await asyncio.Event().wait()  # hangs: only the timeout ends it
            return {"k": key, "attempt": self._attempts[key]}

    loader = aioloader.DataLoader(SlowOnce(), 6, batch_size=3, quiet=True,
                                  retries=Retry(1, backoff=0, timeout=0.2))
    batches = list(loader)
    assert [b["k"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
    assert batches[0]["attempt"].tolist() == [1, 1, 2]


@pytest.mark.deadline(180)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["reader", "map"])
def test_skip_reports_every_skipped_key_and_delivers_the_rest(
        num_workers: int, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    bad = frozenset({4, 5, 6, 7, 13})  # 4..7: one whole batch of the map-style plan
    source: Any = Keys(always_fail=bad) if kind == "reader" else _FailingItems(bad)
    args = (40,) if kind == "reader" else ()
    loader = aioloader.DataLoader(source, *args, batch_size=4, num_workers=num_workers,
                                  on_error="skip", retries=Retry(1, backoff=0),
                                  concurrency=4 if kind == "map" else None, quiet=True)
    with caplog.at_level(logging.WARNING, logger="aioloader"):
        got = [k for b in keys_of(loader) for k in b]
    rest = [k for k in range(40) if k not in bad]
    if kind == "map" or num_workers == 0:
        assert got == rest  # in order, nothing else lost
    else:  # shards taken round-robin, batch by batch
        assert sorted(got) == rest
    # (workers may have started the next epoch's batches already: its skips count too)
    assert {s.key for s in loader.skipped} == bad
    if num_workers == 0:
        assert sorted(s.key for s in loader.skipped) == sorted(bad)
    assert all(s.attempts == 2 and "injected failure" in s.error for s in loader.skipped)
    want_workers = {None} if num_workers == 0 else {k % num_workers for k in bad} \
        if kind == "reader" else set(range(num_workers))
    assert {s.worker for s in loader.skipped} <= want_workers | {None}
    assert loader.stats().skipped == len(loader.skipped)
    logged = [r.getMessage() for r in caplog.records if "skipped key" in r.getMessage()]
    assert len(logged) == len(loader.skipped)  # never silent


class _FailingItems(torch.utils.data.Dataset[Any]):
    def __init__(self, bad: frozenset[int]) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 40

    async def __getitem__(self, i: int) -> dict[str, int]:
        await asyncio.sleep(0)
        if i in self.bad:
            raise ConnectionResetError(f"injected failure of item {i}")
        return {"k": i}


@pytest.mark.deadline(120)
def test_skip_stops_when_everything_fails() -> None:
    loader = aioloader.DataLoader(Keys(always_fail=frozenset(range(1000))), 1000,
                                  batch_size=4, on_error="skip", quiet=True)
    logging.getLogger("aioloader").disabled = True
    try:
        with pytest.raises(LoadError, match="64 loads failed in a row"):
            list(loader)
    finally:
        logging.getLogger("aioloader").disabled = False


# ------------------------------------------------------------------ order, resume


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_unordered_delivers_every_key_once(num_workers: int) -> None:
    loader = aioloader.DataLoader(_Jitter(), 120, batch_size=8, num_workers=num_workers,
                                  concurrency=16, ordered=False, quiet=True)
    got = [k for b in keys_of(loader) for k in b]
    assert sorted(got) == list(range(120))
    assert loader.state_dict()["pass"] == 1  # resumable (tests/test_unordered_resume.py)


class _Jitter(Keys):
    async def load(self, key: int) -> dict[str, Any]:
        for _ in range((key * 7919) % 5):  # later keys may finish first
            await asyncio.sleep(0)
        return {"k": key}


@pytest.mark.deadline(180)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("lazy", [None, 8])
def test_resume_with_a_load_stage_is_exact(num_workers: int, lazy: int | None) -> None:
    def make() -> aioloader.DataLoader:
        return aioloader.DataLoader(Keys(always_fail=frozenset({9})), 60, batch_size=4,
                                    shuffle=True, seed=5, num_workers=num_workers,
                                    max_instances_in_memory=lazy, on_error="skip",
                                    concurrency=8, quiet=True)

    logging.getLogger("aioloader").disabled = True
    try:
        with make() as full:
            want = keys_of(full)
        got: list[list[int]] = []
        state = None
        for cut in (3, 7):
            with make() as part:
                if state is not None:
                    part.load_state_dict(json.loads(state))
                for batch in part:
                    got.append(batch["k"].tolist())
                    if len(got) == cut:
                        break
                state = json.dumps(part.state_dict())
        with make() as rest:
            rest.load_state_dict(json.loads(state))
            got += keys_of(rest)
    finally:
        logging.getLogger("aioloader").disabled = False
    assert got == want


# ------------------------------------------------------------------ cancellation


@pytest.mark.deadline(120)
def test_closing_cancels_100_loads_in_flight_in_this_process(tmp_path: Path) -> None:
    async def main() -> None:
        loader = aioloader.DataLoader(Hang(str(tmp_path)), 500, batch_size=10,
                                      concurrency=100, quiet=True)
        threads = set(threading.enumerate())
        fds = set(os.listdir("/proc/self/fd"))
        consumer = asyncio.ensure_future(_first(loader))
        while len(list(tmp_path.glob("*.started"))) < 100:  # the loads write as they start
            await asyncio.sleep(0.01)
            assert not consumer.done()
        assert len(list(tmp_path.glob("*.started"))) == 100  # the window, no more
        await loader.aclose()
        with pytest.raises(aioloader.LoaderClosedError):
            await consumer
        assert len(list(tmp_path.glob("*.cancelled"))) == 100
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert set(threading.enumerate()) <= threads | _executor_threads()
        assert set(os.listdir("/proc/self/fd")) <= fds | {str(i) for i in range(3)}

    asyncio.run(main())


def _executor_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("asyncio_", "aioloader"))}


async def _first(loader: aioloader.DataLoader) -> Any:
    async for batch in loader:
        return batch
    return None


@pytest.mark.deadline(120)
def test_closing_cancels_100_loads_in_flight_in_workers(tmp_path: Path) -> None:
    async def main() -> None:
        loader = aioloader.DataLoader(Hang(str(tmp_path)), 500, batch_size=10, num_workers=2,
                                      concurrency=50, quiet=True)
        consumer = asyncio.ensure_future(_first(loader))
        while len(list(tmp_path.glob("*.started"))) < 100:
            await asyncio.sleep(0.01)
            assert not consumer.done()
        await asyncio.wait_for(loader.aclose(), 30)  # promptly: EOF cancels the loads
        with pytest.raises(aioloader.LoaderClosedError):
            await consumer
        # every load in flight was cancelled (not killed with its process)
        assert len(list(tmp_path.glob("*.cancelled"))) == 100

    asyncio.run(main())


# ------------------------------------------------------------------ bad input


def test_options_of_a_load_stage_without_one_are_refused() -> None:
    with pytest.raises(ValueError, match="concurrency configure the load stage"):
        aioloader.DataLoader(Plain(), 3, batch_size=2, concurrency=4)
    with pytest.raises(ValueError, match="retries, on_error configure the load stage"):
        aioloader.DataLoader(list(range(3)), batch_size=2, retries=2, on_error="skip")
    with pytest.raises(ValueError, match='on_error must be "raise" or "skip"'):
        aioloader.DataLoader(Keys(), 3, batch_size=2, on_error="ignore")
    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        aioloader.DataLoader(Keys(), 3, batch_size=2, concurrency=0)
    with pytest.raises(ValueError, match="ordered=False applies to readers"):
        aioloader.DataLoader(AsyncItems(3), batch_size=2, ordered=False)
    with pytest.raises(ValueError, match="ordered=False cannot be combined"):
        aioloader.DataLoader(Keys(), 3, batch_size=2, ordered=False, num_workers=1,
                             max_batches_per_worker=10)
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        Retry(-1)
    with pytest.raises(ValueError, match="load_fn must be callable"):
        aioloader.DataLoader(Names(3), batch_size=2, load_fn="fetch")  # type: ignore[arg-type]


def test_a_load_error_pickles_with_its_fields() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(LoadError("s3://b/k", 1, 3, ConnectionResetError("x"))))
    assert (err.key, err.worker_id, err.attempts) == ("s3://b/k", 1, 3)
    assert "loading key 's3://b/k' failed in worker 1 after 3 attempt(s)" in str(err)


@pytest.mark.deadline(180)
@pytest.mark.parametrize("start_method", ["spawn"])
def test_the_load_stage_under_spawn(start_method: str) -> None:
    """The source, its load and the options travel pickled; skips still come back."""
    logging.getLogger("aioloader").disabled = True
    try:
        with aioloader.DataLoader(AsyncKeys(always_fail=frozenset({11})), 40, batch_size=4,
                                  num_workers=2, start_method=start_method, concurrency=4,
                                  on_error="skip", max_instances_in_memory=8,
                                  quiet=True) as loader:
            got = sorted(k for b in keys_of(loader) for k in b)
            skipped = {s.key for s in loader.skipped}  # (the next epoch's prefetch too)
        with aioloader.DataLoader(Names(12), batch_size=4, num_workers=2,
                                  start_method=start_method, load_fn=load_name_blocking,
                                  quiet=True) as names:
            assert [b["k"].tolist() for b in names] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                        [8, 9, 10, 11]]
    finally:
        logging.getLogger("aioloader").disabled = False
    assert got == [k for k in range(40) if k != 11]
    assert skipped == {11}


@pytest.mark.deadline(120)
def test_two_loaders_with_load_stages_at_once_and_one_dropped() -> None:
    """Users keep several loaders alive, and drop some unclosed: nothing mixes or leaks."""
    a = aioloader.DataLoader(Keys(delay=0.001), 30, batch_size=5, num_workers=2,
                             concurrency=4, quiet=True)
    b = aioloader.DataLoader(AsyncItems(30), batch_size=5, num_workers=2, concurrency=4,
                             quiet=True)
    got_a, got_b = [], []
    for x, y in zip(a, b, strict=True):
        got_a += x["k"].tolist()
        got_b += y["k"].tolist()
    assert sorted(got_a) == list(range(30)) and got_b == list(range(30))
    it = iter(aioloader.DataLoader(Keys(), 100, batch_size=5, num_workers=2, quiet=True,
                                   concurrency=8))
    next(it)
    del it  # dropped half-way, never closed: the collector's backstop stops its workers
    a.close()
    b.close()
