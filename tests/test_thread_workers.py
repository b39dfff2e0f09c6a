"""Thread workers (``worker_type="thread"``, issue 13): the same batches as processes, by
reference, with per-thread worker info and a lifetime that leaves no thread behind."""

from __future__ import annotations

import asyncio
import gc
import json
import pickle
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud
import torch.utils.data._utils.collate as torch_collate
import torch.utils.data._utils.worker as torch_worker

import aioloader
from tests.core_sources import AsyncReader, Squares, SyncReader

pytestmark = pytest.mark.deadline(90)

DEADLINE = 30.0  # seconds a thread gets to end; generous for a loaded CI machine
TORCH_GET_WORKER_INFO = torch_worker.get_worker_info.__code__


def ours(data: Any, **kwargs: Any) -> aioloader.DataLoader:
    return aioloader.DataLoader(data, quiet=True, **kwargs)


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aioloader-worker-")]


def assert_threads_end() -> None:
    """Every thread worker ends within the deadline (joined, not polled)."""
    for t in worker_threads():
        t.join(DEADLINE)
    assert worker_threads() == []
    assert torch_worker.get_worker_info.__code__ is TORCH_GET_WORKER_INFO  # unhooked


def indices(loader: Any, key: str = "index") -> list[list[int]]:
    return [b[key].tolist() for b in loader]


class SelfSplitting(tud.IterableDataset[dict[str, Any]]):
    """Shards itself the torch way, with torch.utils.data.get_worker_info()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"index": i, "wid": -1 if info is None else info.id}


class WhoAmI(tud.Dataset[dict[str, Any]]):
    """Records, per sample, what each API says in the thread that fetched it."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        ours_ = aioloader.get_worker_info()
        theirs = tud.get_worker_info()
        assert ours_ is not None and theirs is not None
        return {"index": i, "ours": ours_.id, "theirs": theirs.id, "seed": ours_.seed,
                "thread": threading.current_thread().name, "dataset": theirs.dataset is self}


class Failing(tud.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise KeyError(f"no item {i}")
        return i


class Unpicklable(Exception):
    def __init__(self, lock: Any) -> None:
        super().__init__("holds a lock")
        self.lock = lock

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle")


class RaisesUnpicklable(tud.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        raise Unpicklable(threading.Lock())


class Stalls(aioloader.Reader):
    """One instance, then an await that never ends (the thread can still be cancelled)."""

    def __init__(self) -> None:
        self.first = threading.Event()

    async def read(self, data_path: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"index": 0}
        self.first.set()
        await asyncio.Event().wait()


class Recording:
    """A collate that remembers the batches it returned (from any worker thread)."""

    def __init__(self) -> None:
        self.made: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    def __call__(self, samples: list[dict[str, Any]]) -> torch.Tensor:
        batch = torch.stack([s["sq"] for s in samples])
        with self.lock:
            self.made[batch.data_ptr()] = batch
        return batch


# ------------------------------------------------------------------ same batches

@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_map_style_same_batches_as_processes(num_workers: int) -> None:
    kwargs = dict(batch_size=3, shuffle=True, seed=11, num_workers=num_workers)
    with ours(Squares(29), **kwargs) as procs:
        expected = [indices(procs) for _ in range(2)]  # two epochs: reshuffled
    with ours(Squares(29), worker_type="thread", **kwargs) as threads:
        got = [indices(threads) for _ in range(2)]
    assert got == expected
    assert got[0] != got[1]
    assert_threads_end()


@pytest.mark.parametrize("num_workers", [1, 2, 4])
@pytest.mark.parametrize("reader", [SyncReader, AsyncReader])
def test_readers_same_batches_as_processes(reader: type, num_workers: int) -> None:
    kwargs = dict(batch_size=4, shuffle=True, seed=3, max_instances_in_memory=8,
                  num_workers=num_workers)
    with ours(reader(37), **kwargs) as procs:
        expected = indices(procs)
    with ours(reader(37), worker_type="thread", **kwargs) as threads:
        got = indices(threads)
        assert {w for b in threads for w in b["wid"].tolist()} == set(range(num_workers))
    assert got == expected
    assert sorted(i for b in got for i in b) == list(range(37))
    assert_threads_end()


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_iterable_dataset_splits_itself_as_with_processes(num_workers: int) -> None:
    kwargs = dict(batch_size=2, num_workers=num_workers)
    with ours(SelfSplitting(21), **kwargs) as procs:
        expected = indices(procs)
    with ours(SelfSplitting(21), worker_type="thread", **kwargs) as threads:
        got = indices(threads)
        wids = {w for b in threads for w in b["wid"].tolist()}
    assert got == expected
    assert sorted(i for b in got for i in b) == list(range(21))  # split, not read n times
    assert wids == set(range(num_workers))
    assert_threads_end()


async def test_async_face() -> None:
    async with ours(Squares(10), batch_size=4, num_workers=2, worker_type="thread") as loader:
        got = [b["index"].tolist() async for b in loader]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert_threads_end()


# ------------------------------------------------------------------ worker info

def test_worker_info_per_thread_and_none_on_main() -> None:
    seen_on_main = []
    with ours(WhoAmI(), batch_size=2, num_workers=2, worker_type="thread") as loader:
        batches = []
        for batch in loader:  # while the worker threads run
            seen_on_main.append((aioloader.get_worker_info(), tud.get_worker_info()))
            batches.append(batch)
    assert seen_on_main == [(None, None)] * 8
    for b in batches:
        assert b["ours"].tolist() == b["theirs"].tolist()
        assert b["dataset"].tolist() == [True, True]
        # map-style batches go to worker seq % n: worker k fetched batch k, k + 2, ...
        assert {f"aioloader-worker-{w}" for w in b["ours"].tolist()} == set(b["thread"])
    seeds = {b["ours"][0].item(): b["seed"][0].item() for b in batches}
    assert len(set(seeds.values())) == 2  # per worker
    assert_threads_end()


def test_main_process_rng_is_not_reseeded() -> None:
    random.seed(1234)
    torch.manual_seed(1234)
    before = (random.getstate(), torch.get_rng_state(), torch.initial_seed())
    with ours(Squares(12), batch_size=4, num_workers=2, worker_type="thread") as loader:
        list(loader)
    assert (random.getstate(), torch.initial_seed()) == (before[0], before[2])
    # One draw, the base seed, as torch's own DataLoader draws when its iterator starts.
    after = torch.get_rng_state()
    torch.set_rng_state(before[1])
    list(torch.utils.data.DataLoader(Squares(12), batch_size=4, num_workers=2))
    assert torch.equal(after, torch.get_rng_state())
    assert not torch.equal(after, before[1])
    assert_threads_end()


def test_worker_init_fn_runs_in_each_thread() -> None:
    calls: list[tuple[int, str, int | None]] = []

    def init(worker_id: int) -> None:
        info = aioloader.get_worker_info()
        calls.append((worker_id, threading.current_thread().name,
                      None if info is None else info.id))

    with ours(Squares(8), batch_size=2, num_workers=2, worker_type="thread",
              worker_init_fn=init) as loader:
        list(loader)
    assert sorted(calls) == [(0, "aioloader-worker-0", 0), (1, "aioloader-worker-1", 1)]
    assert_threads_end()


# ------------------------------------------------------------------ batches by reference

def test_batches_are_handed_over_not_copied() -> None:
    collate = Recording()
    with ours(Squares(20), batch_size=4, num_workers=2, worker_type="thread",
              collate_fn=collate) as loader:
        got = list(loader)
    assert len(got) == 5
    for batch in got:
        assert collate.made[batch.data_ptr()] is batch  # the very tensor collate returned
    assert [b.tolist() for b in got] == [[float(i * i) for i in range(k, k + 4)]
                                         for k in range(0, 20, 4)]
    assert_threads_end()


def test_torch_default_collate_makes_no_shared_memory_in_threads() -> None:
    original = torch_collate.default_collate_fn_map[torch.Tensor]
    with ours(Squares(8), batch_size=4, num_workers=2, worker_type="thread",
              collate_fn=tud.default_collate) as loader:
        got = list(loader)
        # The main thread's torch is untouched while the threads run.
        assert not tud.default_collate([torch.zeros(2), torch.ones(2)]).is_shared()
    assert [b["sq"].tolist() for b in got] == [[0.0, 1.0, 4.0, 9.0], [16.0, 25.0, 36.0, 49.0]]
    assert not any(b["sq"].is_shared() for b in got)
    assert_threads_end()
    assert torch_collate.default_collate_fn_map[torch.Tensor] is original


# ------------------------------------------------------------------ errors

def test_worker_error_keeps_the_original_type() -> None:
    loader = ours(Failing(), batch_size=2, num_workers=2, worker_type="thread")
    with loader, pytest.raises(KeyError) as caught:
        list(loader)
    err = caught.value
    assert isinstance(err, aioloader.WorkerError)
    assert "no item 5" in str(err) and "__getitem__" in str(err)  # the worker's traceback
    assert isinstance(err.__cause__, KeyError)
    assert_threads_end()


def test_unpicklable_exception_arrives_by_reference() -> None:
    with pytest.raises(TypeError):
        pickle.dumps(Unpicklable(threading.Lock()))
    loader = ours(RaisesUnpicklable(), batch_size=2, num_workers=1, worker_type="thread")
    with loader, pytest.raises(Unpicklable) as caught:
        list(loader)
    assert isinstance(caught.value, aioloader.WorkerError)
    assert isinstance(caught.value.__cause__, Unpicklable)
    assert_threads_end()


# ------------------------------------------------------------------ lifetime

def test_close_from_another_thread_ends_the_consumer() -> None:
    reader = Stalls()
    loader = ours(reader, batch_size=1, num_workers=1, worker_type="thread")
    outcome: list[BaseException | None] = []

    def consume() -> None:
        try:
            for _ in loader:
                pass
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert reader.first.wait(DEADLINE)
    began = time.monotonic()
    loader.close()
    consumer.join(DEADLINE)
    assert not consumer.is_alive()
    assert isinstance(outcome[0], aioloader.LoaderClosedError), outcome
    assert time.monotonic() - began < 5.0  # promptly: the stalled await was cancelled
    assert_threads_end()


def test_unclosed_loader_leaves_no_thread() -> None:
    loader = ours(SyncReader(12), batch_size=4, num_workers=2, worker_type="thread")
    assert len(list(loader)) == 3  # a completed epoch: its workers persist
    assert len(worker_threads()) == 2
    del loader
    gc.collect()
    assert_threads_end()


def test_break_stops_the_epoch_threads() -> None:
    loader = ours(Squares(40), batch_size=2, num_workers=2, worker_type="thread")
    for _ in loader:
        break
    loader.close()
    assert_threads_end()


def test_thread_and_process_loaders_side_by_side() -> None:
    """A process loader forks while thread workers run: the children hold none of their fds
    (else a thread's EOF and sentinel would wait for those children)."""
    threads = ours(Squares(24), batch_size=4, num_workers=2, worker_type="thread")
    procs = ours(Squares(24), batch_size=4, num_workers=2, start_method="fork")
    with threads, procs:
        assert indices(threads) == indices(procs)  # threads persist while procs fork
        got = [(a["index"].tolist(), b["index"].tolist()) for a, b in zip(threads, procs,
                                                                              strict=True)]
        assert all(x == y for x, y in got)
    assert_threads_end()


def test_timeout() -> None:
    loader = ours(Stalls(), batch_size=2, num_workers=1, worker_type="thread", timeout=0.5)
    with loader, pytest.raises(aioloader.LoaderTimeoutError, match="worker 0"):
        list(loader)
    assert_threads_end()


# ------------------------------------------------------------------ resume

@pytest.mark.parametrize("source", ["map", "reader"])
def test_state_dict_resumes(source: str) -> None:
    def make() -> aioloader.DataLoader:
        data = Squares(30) if source == "map" else SyncReader(30)
        return ours(data, batch_size=3, shuffle=True, seed=7, num_workers=2,
                    worker_type="thread", max_instances_in_memory=6)

    with make() as whole:
        expected = indices(whole)
    with make() as first:
        it = iter(first)
        head = [next(it)["index"].tolist() for _ in range(4)]
        state = json.loads(json.dumps(first.state_dict()))
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = indices(resumed)
    assert head + rest == expected
    assert_threads_end()


# ------------------------------------------------------------------ options

def test_worker_type_is_validated() -> None:
    with pytest.raises(ValueError, match="'process', 'thread'"):
        ours(Squares(4), batch_size=2, worker_type="fiber")
    for option in ({"max_worker_restarts": 1}, {"max_batches_per_worker": 10},
                   {"max_worker_rss": 1 << 30}):
        with pytest.raises(ValueError, match="worker_type='thread'"):
            ours(Squares(4), batch_size=2, num_workers=2, worker_type="thread", **option)


def test_start_method_does_not_apply_to_threads() -> None:
    with ours(Squares(6), batch_size=3, num_workers=2, worker_type="thread",
              start_method="spawn", collate_fn=lambda s: [x["index"] for x in s]) as loader:
        assert list(loader) == [[0, 1, 2], [3, 4, 5]]  # a lambda: nothing was pickled
    assert_threads_end()


class Positioned(aioloader.Reader):
    """A stateful reader; ``lock`` (a threading.Lock: no copy) makes it uncopyable."""

    def __init__(self, n: int, lock: Any = None) -> None:
        self.n = n
        self.lock = lock

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        info = tud.get_worker_info()  # torch's: dataset too
        assert info is not None and info.dataset is self  # the worker's own copy
        yield from ({"index": i} for i in range(self.n))


def test_several_thread_workers_read_their_own_copy_of_a_stateful_reader() -> None:
    reader = Positioned(8)
    copies: dict[int, Any] = {}

    def init(worker_id: int) -> None:
        info = tud.get_worker_info()  # torch's: dataset too
        assert info is not None
        copies[worker_id] = info.dataset

    loader = ours(reader, batch_size=2, num_workers=2, worker_type="thread", worker_init_fn=init,
                  max_instances_in_memory=2)  # streamed (not read into memory first)
    try:
        assert sorted(i for b in indices(loader) for i in b) == list(range(8))
    finally:
        loader.close()
    assert copies[0] is not copies[1] and reader not in copies.values()
    assert_threads_end()


def test_a_stateful_reader_that_cannot_be_copied_is_refused_with_what_to_do() -> None:
    loader = ours(Positioned(4, threading.Lock()), num_workers=2, worker_type="thread",
                  max_instances_in_memory=1)
    try:
        with pytest.raises(aioloader.SourcePicklingError,
                           match=r"Positioned\).*cannot be copied.*worker_type='process'") as got:
            next(iter(loader))
        assert isinstance(got.value.__cause__, TypeError)
    finally:
        loader.close()
    assert_threads_end()
    lone = ours(Positioned(4, threading.Lock()), num_workers=1, worker_type="thread",
                max_instances_in_memory=1)
    try:  # one worker shares it: nothing to race on
        assert indices(lone) == [[0], [1], [2], [3]]
    finally:
        lone.close()
