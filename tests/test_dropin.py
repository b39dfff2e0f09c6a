"""torch's DataLoader arguments, with torch's meaning (issue 13): each compared with torch.

Moving from ``torch.utils.data.DataLoader`` is meant to be a change of import; these tests
build both loaders with the same arguments and compare what comes out.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import pickle
import random
import warnings
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch
import torch.multiprocessing
import torch.utils.data as tud

import aioloader
from aioloader.testing import is_helper

pytestmark = pytest.mark.deadline(60)

N = 23


class Squares(tud.Dataset[int]):
    """A map-style dataset; ``offset`` is what a worker_init_fn may set, torch-style."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.offset = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * i + self.offset


def batches(loader: Any) -> list[list[int]]:
    return [b.tolist() for b in loader]


def ours(data: Any, **kwargs: Any) -> aioloader.DataLoader:
    return aioloader.DataLoader(data, quiet=True, **kwargs)


# ------------------------------------------------------------------ sampler=

def _weights() -> list[float]:
    return [1.0 + (i % 5) for i in range(N)]


SAMPLERS: dict[str, Callable[[torch.Generator], Any]] = {
    "sequential": lambda g: tud.SequentialSampler(range(N)),
    "random": lambda g: tud.RandomSampler(range(N), generator=g),
    "random-replacement": lambda g: tud.RandomSampler(range(N), replacement=True,
                                                      num_samples=17, generator=g),
    "subset-random": lambda g: tud.SubsetRandomSampler(list(range(3, 19)), generator=g),
    "weighted": lambda g: tud.WeightedRandomSampler(_weights(), 30, generator=g),
    "plain-list": lambda g: [5, 1, 4, 1, 5, 9, 2, 6],
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_sampler_gives_torchs_batches(kind: str, drop_last: bool, num_workers: int) -> None:
    # Each side gets its own sampler, from a generator seeded the same: torch's batches are
    # deterministic given it, so they must match exactly, epoch after epoch.
    make = SAMPLERS[kind]
    theirs = tud.DataLoader(Squares(), batch_size=4, drop_last=drop_last,
                            sampler=make(torch.Generator().manual_seed(11)))
    with ours(Squares(), batch_size=4, drop_last=drop_last, num_workers=num_workers,
              sampler=make(torch.Generator().manual_seed(11))) as loader:
        assert len(loader) == len(theirs)
        for _ in range(2):
            assert batches(loader) == batches(theirs)


def test_distributed_sampler_set_epoch_is_the_users() -> None:
    data = Squares()
    mine = tud.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5)
    torchs = tud.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5)
    theirs = tud.DataLoader(data, batch_size=3, sampler=torchs)
    with ours(data, batch_size=3, sampler=mine, num_workers=2) as loader:
        assert loader.sampler is mine  # as torch's loader.sampler
        assert loader.batch_sampler.sampler is mine
        seen = []
        for epoch in (0, 1, 1, 4):
            mine.set_epoch(epoch)
            torchs.set_epoch(epoch)
            got = batches(loader)
            assert got == batches(theirs)
            seen.append(got)
        assert seen[0] != seen[1] and seen[1] == seen[2]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shuffle": True}, "mutually exclusive with shuffle"),
    ({"batch_sampler": tud.BatchSampler(range(N), 2, False), "batch_size": 1},
     "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler"),
    ({"batch_size": None, "drop_last": True}, "mutually exclusive with drop_last"),
])
def test_sampler_rules(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"batch_size": 2, "sampler": tud.SequentialSampler(range(N))}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ours(Squares(), **args)


def test_sampler_needs_a_map_style_dataset() -> None:
    class Stream(tud.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(4))

    with pytest.raises(ValueError, match="sampler"):
        tud.DataLoader(Stream(), sampler=[0, 1])
    with pytest.raises(ValueError, match="map-style"):
        ours(Stream(), batch_size=2, sampler=[0, 1])


# ------------------------------------------------------------------ worker_init_fn

class Record:
    """A picklable worker_init_fn: a file per call, named by pid and worker id; it also
    sets the dataset's offset, which every batch must show (torch's idiom)."""

    def __init__(self, where: pathlib.Path) -> None:
        self.where = where

    def __call__(self, worker_id: int) -> None:
        info = tud.get_worker_info()
        assert info is not None and info.id == worker_id
        assert torch.initial_seed() == info.seed  # seeded before
        info.dataset.offset = 1000  # before any data is read
        (self.where / f"{os.getpid()}-{worker_id}").touch()


def calls(where: pathlib.Path) -> list[tuple[int, int]]:
    return sorted((int(p.name.split("-")[0]), int(p.name.split("-")[1]))
                  for p in where.iterdir())


@pytest.mark.parametrize("persistent", [True, False])
def test_worker_init_fn_once_per_worker_process(tmp_path: pathlib.Path,
                                                persistent: bool) -> None:
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    theirs = tud.DataLoader(Squares(), batch_size=4, num_workers=2,
                            worker_init_fn=Record(tmp_path / "torch"),
                            persistent_workers=persistent)
    expected = [[v + 1000 for v in b] for b in batches(tud.DataLoader(Squares(), 4))]
    with ours(Squares(), batch_size=4, num_workers=2, persistent_workers=persistent,
              worker_init_fn=Record(tmp_path / "ours")) as loader:
        for _ in range(2):
            assert batches(loader) == expected
            assert batches(theirs) == expected
    del theirs  # its persistent workers go with it
    mine, torchs = calls(tmp_path / "ours"), calls(tmp_path / "torch")
    assert len({pid for pid, _ in mine}) == len(mine)  # once per process
    assert sorted(k for _, k in mine) == sorted(k for _, k in torchs)
    assert sorted(k for _, k in mine) == ([0, 0, 1, 1] if not persistent else [0, 1])


def test_worker_init_fn_runs_in_recycled_workers(tmp_path: pathlib.Path) -> None:
    with ours(Squares(), batch_size=2, num_workers=2, max_batches_per_worker=2,
              worker_init_fn=Record(tmp_path)) as loader:
        got = batches(loader)
    assert got == [[v + 1000 for v in b] for b in batches(tud.DataLoader(Squares(), 2))]
    made = calls(tmp_path)
    assert len(made) >= 4 and len({pid for pid, _ in made}) == len(made)


def test_worker_init_fn_not_called_without_workers(tmp_path: pathlib.Path) -> None:
    with ours(Squares(), batch_size=4, worker_init_fn=Record(tmp_path)) as loader:
        assert batches(loader) == batches(tud.DataLoader(Squares(), 4))
    assert calls(tmp_path) == []


class Draws(aioloader.Reader):
    """Each worker yields draws from the global `random`, which its worker_init_fn seeded."""

    manual_multiprocess_sharding = True

    def read(self, data_path: Any) -> Any:
        info = aioloader.get_worker_info()
        worker = info.id if info is not None else -1
        for _ in range(3):
            yield {"worker": worker, "draw": random.random()}


def seed_random(worker_id: int) -> None:
    random.seed(1234 + worker_id)


@pytest.mark.parametrize("lazy", [False, True])
def test_worker_init_fn_seeding_is_not_undone(lazy: bool) -> None:
    with ours(Draws(), batch_size=1, num_workers=2, worker_init_fn=seed_random,
              max_instances_in_memory=4 if lazy else None) as loader:
        got = [(int(b["worker"]), float(b["draw"])) for b in loader]
    for k in (0, 1):
        rng = random.Random(1234 + k)
        assert [d for w, d in got if w == k] == [rng.random() for _ in range(3)]


def fail_init(worker_id: int) -> None:
    raise RuntimeError(f"no GPU for worker {worker_id}")


def test_worker_init_fn_error_is_the_workers() -> None:
    with (ours(Squares(), batch_size=4, num_workers=1, worker_init_fn=fail_init) as loader,
          pytest.raises(RuntimeError, match="no GPU for worker 0") as info):
        batches(loader)
    assert isinstance(info.value, aioloader.WorkerError)


def test_worker_init_fn_must_pickle_for_spawn() -> None:
    with (ours(Squares(), batch_size=4, num_workers=1, start_method="spawn",
               worker_init_fn=lambda k: None) as loader,
          pytest.raises(aioloader.SourcePicklingError, match="worker_init_fn")):
        batches(loader)


# ------------------------------------------------------------------ persistent_workers

def children(before: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Our descendants, less ``before`` and multiprocessing's helpers (a resource tracker
    or forkserver, started by any loader, stays for good)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and not is_helper(p.pid)]


def baseline() -> frozenset[int]:
    return frozenset(p.pid for p in children())


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_workers(persistent: bool) -> None:
    expected = batches(tud.DataLoader(Squares(), 4))
    before = baseline()
    with ours(Squares(), batch_size=4, num_workers=2, persistent_workers=persistent) as loader:
        pids = []
        for _ in range(3):
            assert batches(loader) == expected
            left = children(before)
            assert len(left) == (2 if persistent else 0)
            pids.append({p.pid for p in left})
        if persistent:
            assert pids[0] == pids[1] == pids[2]  # the same processes, epoch after epoch


def test_persistent_workers_false_between_sync_and_async_epochs() -> None:
    import asyncio

    async def epoch(loader: aioloader.DataLoader) -> list[list[int]]:
        return [b.tolist() async for b in loader]

    expected = batches(tud.DataLoader(Squares(), 4))
    before = baseline()
    loader = ours(Squares(), batch_size=4, num_workers=2, persistent_workers=False)
    try:
        assert asyncio.run(epoch(loader)) == expected
        assert children(before) == []
        it = iter(loader)
        assert [next(it).tolist() for _ in range(len(loader))] == expected  # no end asked
        del it
        assert batches(loader) == expected
        assert children(before) == []
    finally:
        loader.close()


@pytest.mark.parametrize("source", ["map", "lazy-reader"])
def test_persistent_workers_false_stream_goes_on(source: str) -> None:
    # batches_per_epoch: the stream continues across epochs, workers or not between them.
    def make(persistent: bool) -> aioloader.DataLoader:
        if source == "map":
            return ours(Squares(), batch_size=2, shuffle=True, seed=3, num_workers=2,
                        batches_per_epoch=5, persistent_workers=persistent)
        return ours(Numbers(), batch_size=2, num_workers=1, max_instances_in_memory=4,
                    batches_per_epoch=5, persistent_workers=persistent)

    before = baseline()
    with make(True) as kept, make(False) as stopped:
        for _ in range(4):  # 20 batches: across pass boundaries
            assert batches(stopped) == batches(kept)
            assert len(children(before)) == kept.num_workers  # kept's only


class Numbers(aioloader.Reader):
    def read(self, data_path: Any) -> Any:
        yield from range(15)


# ------------------------------------------------------------------ prefetch_factor

def test_prefetch_factor() -> None:
    with ours(Squares(), batch_size=4, num_workers=2, prefetch_factor=1) as loader:
        assert loader.prefetch == 1
        assert batches(loader) == batches(tud.DataLoader(Squares(), 4, num_workers=0))
    assert ours(Squares(), batch_size=4, num_workers=2, prefetch=3, prefetch_factor=3).prefetch == 3
    assert ours(Squares(), batch_size=4).prefetch == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_workers": 0, "prefetch_factor": 2}, "num_workers > 0"),
    ({"num_workers": 2, "prefetch_factor": 2, "prefetch": 3}, "same option"),
    ({"num_workers": 2, "prefetch_factor": 0}, ">= 1"),
])
def test_prefetch_factor_rules(kwargs: dict[str, Any], match: str) -> None:
    if kwargs.get("num_workers") == 0:
        with pytest.raises(ValueError):
            tud.DataLoader(Squares(), **kwargs)
    with pytest.raises(ValueError, match=match):
        ours(Squares(), batch_size=2, **kwargs)


# ------------------------------------------------------------------ generator

@pytest.mark.parametrize("num_workers", [0, 2])
def test_generator_seeds_the_loader(num_workers: int) -> None:
    def make(seed: int) -> aioloader.DataLoader:
        return ours(Squares(), batch_size=4, shuffle=True, num_workers=num_workers,
                    generator=torch.Generator().manual_seed(seed))

    with make(7) as a, make(7) as b, make(8) as c:
        first = [batches(a), batches(a)]
        assert first == [batches(b), batches(b)]
        assert first[0] != first[1]  # reshuffled each epoch
        assert batches(c) != first[0]
    g = torch.Generator().manual_seed(7)
    draw = torch.empty((), dtype=torch.int64).random_(generator=g).item()
    assert ours(Squares(), batch_size=4, generator=torch.Generator().manual_seed(7)
                ).state_dict()["seed"] == draw  # torch's base seed
    given = ours(Squares(), batch_size=4, seed=5, generator=torch.Generator().manual_seed(7))
    assert given.state_dict()["seed"] == 5  # an explicit seed wins
    with pytest.raises(ValueError, match=r"torch\.Generator"):
        ours(Squares(), batch_size=4, generator=7)


# ------------------------------------------------------------------ in_order

@pytest.mark.parametrize("in_order", [True, False])
def test_in_order(in_order: bool) -> None:
    # False is accepted; batches of a map-style dataset still come in the sampler's order.
    sampler = tud.RandomSampler(range(N), generator=torch.Generator().manual_seed(2))
    again = tud.RandomSampler(range(N), generator=torch.Generator().manual_seed(2))
    theirs = tud.DataLoader(Squares(), batch_size=3, sampler=again, num_workers=0)
    with ours(Squares(), batch_size=3, sampler=sampler, num_workers=2,
              in_order=in_order) as loader:
        assert batches(loader) == batches(theirs)
    with pytest.raises(ValueError, match="in_order"):
        ours(Squares(), batch_size=3, in_order="yes")


# ------------------------------------------------------------------ multiprocessing_context

@pytest.mark.parametrize("context", [
    "fork", "spawn", "forkserver", multiprocessing.get_context("spawn"),
    torch.multiprocessing.get_context("forkserver"),
], ids=["fork", "spawn", "forkserver", "mp-spawn", "torch-forkserver"])
def test_multiprocessing_context_maps_to_start_method(context: Any) -> None:
    method = context if isinstance(context, str) else context.get_start_method()
    loader = ours(Squares(), batch_size=4, num_workers=1, multiprocessing_context=context)
    assert loader.start_method == method
    assert loader.multiprocessing_context is context
    tud.DataLoader(Squares(), num_workers=1, multiprocessing_context=context)  # torch agrees


def test_multiprocessing_context_object_runs() -> None:
    with ours(list(range(10)), batch_size=4, num_workers=1,
              multiprocessing_context=multiprocessing.get_context("spawn")) as loader:
        assert batches(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"start_method": "spawn", "multiprocessing_context": "forkserver"}, "conflicts"),
    ({"multiprocessing_context": "threads"}, "should specify a valid start method in"),
    ({"multiprocessing_context": 3}, "get_context"),
])
def test_multiprocessing_context_rules(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ours(Squares(), batch_size=2, num_workers=1, **kwargs)
    assert ours(Squares(), batch_size=2, num_workers=1, start_method="spawn",
                multiprocessing_context="spawn").start_method == "spawn"


# ------------------------------------------------------------------ pin_memory

def torch_warnings(make: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in seen]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_without_an_accelerator_warns_like_torch(num_workers: int) -> None:
    said = torch_warnings(lambda: iter(tud.DataLoader(Squares(), 4, pin_memory=True)))
    assert said and "no accelerator" in said[0]
    with pytest.warns(UserWarning) as seen:
        loader = ours(Squares(), batch_size=4, num_workers=num_workers, pin_memory=True)
    assert [str(w.message) for w in seen] == said[:1]
    with loader:
        got = list(loader)
    assert [b.tolist() for b in got] == batches(tud.DataLoader(Squares(), 4))
    assert not any(b.is_pinned() for b in got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_pins(num_workers: int) -> None:
    with ours(Squares(), batch_size=4, num_workers=num_workers, pin_memory=True) as loader:
        got = list(loader)
        assert all(b.is_pinned() for b in got)
        assert [b.tolist() for b in got] == batches(tud.DataLoader(Squares(), 4))
        on_gpu = list(loader.sync(device="cuda"))
        assert all(b.is_cuda for b in on_gpu)
    theirs = next(iter(tud.DataLoader(Squares(), 4, pin_memory=True)))
    assert theirs.is_pinned()


def test_pin_memory_device_is_accepted() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = ours(Squares(), batch_size=4, pin_memory=True, pin_memory_device="cuda")
    assert loader.pin_memory_device == "cuda"
    with pytest.raises(ValueError, match="pin_memory"):
        ours(Squares(), batch_size=4, pin_memory="yes")


# ------------------------------------------------------------------ timeout

def test_timeout_zero_is_no_timeout() -> None:
    with ours(Squares(), batch_size=4, num_workers=1, timeout=0) as loader:
        assert loader.timeout is None
        assert batches(loader) == batches(tud.DataLoader(Squares(), 4, timeout=0))
    with pytest.raises(ValueError):
        tud.DataLoader(Squares(), 4, timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        ours(Squares(), batch_size=4, timeout=-1)


# ------------------------------------------------------------------ worker exceptions

class MyError(Exception):
    pass


class TwoArgs(Exception):
    def __init__(self, path: str, line: int) -> None:
        super().__init__(path, line)
        self.path, self.line = path, line


RAISES: dict[str, tuple[Callable[[], BaseException], type[BaseException]]] = {
    "KeyError": (lambda: KeyError("missing"), KeyError),
    "ValueError": (lambda: ValueError("bad value"), ValueError),
    "OSError": (lambda: OSError(5, "I/O error"), OSError),
    "FileNotFoundError": (lambda: FileNotFoundError(2, "No such file", "/x/y"),
                          FileNotFoundError),
    "user": (lambda: MyError("mine"), MyError),
    "two-args": (lambda: TwoArgs("data.jsonl", 7), TwoArgs),
}


class Raising(tud.Dataset[int]):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise RAISES[self.kind][0]()
        return i


@pytest.mark.parametrize("kind", list(RAISES))
def test_worker_exception_keeps_its_type(kind: str) -> None:
    make, expected = RAISES[kind]
    with ours(Raising(kind), batch_size=2, num_workers=1) as loader, pytest.raises(
            expected) as info:
        batches(loader)
    err = info.value
    assert isinstance(err, aioloader.WorkerError)
    assert err.worker_id == 0 and err.pid is not None
    assert "Traceback from the worker" in str(err) and "__getitem__" in str(err)
    original = make()
    cause = err.__cause__
    assert type(cause) is expected and cause.args == original.args
    if isinstance(original, OSError):
        assert isinstance(err, OSError)
        assert (err.errno, err.filename) == (original.errno, original.filename)
    if isinstance(original, TwoArgs):
        assert (err.path, err.line) == ("data.jsonl", 7)  # type: ignore[attr-defined]
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, expected) and isinstance(again, aioloader.WorkerError)
    assert str(again) == str(err)
    # without workers, the original itself (as torch)
    with ours(Raising(kind), batch_size=2) as loader, pytest.raises(expected) as info:
        batches(loader)
    assert type(info.value) is expected


def test_worker_exception_still_a_worker_error() -> None:
    with ours(Raising("KeyError"), batch_size=2, num_workers=1) as loader:
        try:
            batches(loader)
        except aioloader.WorkerError as err:
            caught: BaseException = err
    assert isinstance(caught, KeyError)
    with pytest.raises(KeyError):  # torch re-raises the original type too
        batches(tud.DataLoader(Raising("KeyError"), 2, num_workers=1))


@pytest.mark.parametrize("original", [
    StopIteration("ran dry"), StopAsyncIteration(), MemoryError(),
    ExceptionGroup("two", [ValueError(1), KeyError(2)]), aioloader.WorkerError("nested"),
], ids=lambda e: type(e).__name__)
def test_types_that_cannot_mix_stay_plain_worker_errors(original: BaseException) -> None:
    # A StopAsyncIteration mixed in would end the epoch quietly; MemoryError and
    # ExceptionGroup refuse a subclass made so. (A KeyboardInterrupt or SystemExit, no
    # Exception, ends a torch worker: a RuntimeError, test_users_ulife.py.)
    from aioloader._errors import worker_error_for

    err = worker_error_for(original, "worker 0 raised it", worker_id=0, pid=1)
    assert type(err) is aioloader.WorkerError
    assert (str(err), err.worker_id, err.pid) == ("worker 0 raised it", 0, 1)


@pytest.mark.parametrize("original", [KeyboardInterrupt(), SystemExit(3), GeneratorExit()],
                         ids=lambda e: type(e).__name__)
def test_a_base_exception_that_ends_a_worker_is_a_runtime_error(original: BaseException) -> None:
    # No Exception, so no mix of its own type: torch's parent says "exited unexpectedly".
    from aioloader._errors import worker_error_for

    err = worker_error_for(original, "worker 0 raised it", worker_id=0, pid=1)
    assert isinstance(err, aioloader.WorkerError) and isinstance(err, RuntimeError)
    assert (str(err), err.worker_id, err.pid) == ("worker 0 raised it", 0, 1)
