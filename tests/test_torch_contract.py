"""Torch's contract (issue 32): code written for torch.utils.data.DataLoader that changes only
its import behaves the same. Each test runs torch's loader and ours on the same data."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import aioloader

pytestmark = pytest.mark.deadline(120)
LOADERS = [tud.DataLoader, aioloader.DataLoader]


class Squares(tud.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int | list[int]) -> dict[str, Any]:
        if isinstance(i, list):  # bulk loading: a sampler's list of indices at once
            return {"x": i, "y": torch.tensor([[j * j, -j] for j in i])}
        return {"x": i, "y": torch.tensor([i * i, -i])}


def plain(batch: Any) -> Any:
    """A batch as plain Python values, to compare loaders by."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", batch.dtype, batch.tolist())
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [plain(v) for v in batch])
    return batch


def run(loader: Any) -> list[Any]:
    try:
        return [plain(b) for b in loader]
    finally:
        if isinstance(loader, aioloader.DataLoader):
            loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("args", "kwargs"), [
    ((), {}),  # batch_size=1 by default
    ((5,), {}),  # positional batch_size
    ((5, False, None, None), {"drop_last": True}),  # torch's positional order
    ((), {"batch_size": None}),  # automatic batching off: default_convert
    ((), {"batch_size": None, "sampler": tud.BatchSampler(range(23), 4, False)}),  # bulk
    ((), {"batch_sampler": [[3, 1], [0], [22, 21, 20]]}),
], ids=["default", "positional", "order", "unbatched", "bulk", "batch_sampler"])
def test_batches_are_torchs(args: tuple[Any, ...], kwargs: dict[str, Any],
                            num_workers: int) -> None:
    theirs, ours = (run(loader(Squares(), *args, num_workers=num_workers, **kwargs))
                    for loader in LOADERS)
    assert ours == theirs


def test_dataset_by_name_and_torchs_defaults() -> None:
    loader = aioloader.DataLoader(dataset=Squares())
    assert (loader.batch_size, loader.shuffle, loader.timeout, loader.num_workers,
            loader.persistent_workers) == (1, False, None, 0, False)
    assert len(loader) == len(tud.DataLoader(Squares())) == 23
    names = list(inspect.signature(aioloader.DataLoader).parameters)
    torchs = list(inspect.signature(tud.DataLoader).parameters)
    assert names[:len(torchs)] == torchs  # help() shows torch's form first


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"batch_size": None, "drop_last": True}, ValueError),
    ({"batch_sampler": [[0]], "batch_size": 2}, ValueError),
    ({"batch_sampler": [[0]], "shuffle": True}, ValueError),
    ({"sampler": range(3), "shuffle": True}, ValueError),
    ({"batch_size": 0}, ValueError),
    ({"num_workers": -1}, ValueError),
    ({"no_such_argument": 1}, TypeError),
])
def test_refusals_are_torchs_types(kwargs: dict[str, Any], error: type[Exception]) -> None:
    for loader in LOADERS:
        with pytest.raises(error):
            loader(Squares(), **kwargs)


def test_setting_an_option_afterwards_is_a_value_error_as_torchs() -> None:
    for loader in (tud.DataLoader(Squares()), aioloader.DataLoader(Squares())):
        for name, value in (("batch_size", 3), ("dataset", Squares())):
            with pytest.raises(ValueError):
                setattr(loader, name, value)


def test_subscripted_in_annotations() -> None:
    alias = aioloader.DataLoader[torch.Tensor]
    assert alias.__origin__ is aioloader.DataLoader  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_manual_seed_reproduces_shuffles_and_worker_seeds(num_workers: int) -> None:
    def seeds(_: list[Any]) -> Any:
        info = tud.get_worker_info()
        return torch.tensor(info.seed if info is not None else torch.initial_seed())

    def two_epochs(loader_type: Any, seed: int) -> tuple[list[Any], list[Any]]:
        torch.manual_seed(seed)
        order = loader_type(range(40), batch_size=8, shuffle=True, num_workers=num_workers)
        seen = [run(order), run(order)]
        torch.manual_seed(seed)
        drawn = loader_type(range(4), batch_size=1, num_workers=num_workers, collate_fn=seeds)
        return seen, run(drawn)

    for loader_type in LOADERS:
        (first, second), worker_seeds = two_epochs(loader_type, 0)
        assert first != second  # each epoch differs
        assert two_epochs(loader_type, 0) == ([first, second], worker_seeds)
        assert two_epochs(loader_type, 1)[0] != [first, second]


def test_timeouts_and_dead_workers_are_runtime_errors() -> None:
    assert issubclass(aioloader.LoaderTimeoutError, RuntimeError)
    assert issubclass(aioloader.LoaderTimeoutError, TimeoutError)
    assert issubclass(aioloader.WorkerDied, RuntimeError)


def test_too_many_workers_warn_as_torchs() -> None:
    import os

    many = len(os.sched_getaffinity(0)) + 1
    for loader in LOADERS:
        with pytest.warns(UserWarning, match="excessive worker creation"):
            it = iter(loader(Squares(), num_workers=many))
            del it


class Split(tud.IterableDataset[int]):
    """Splits itself between workers the way torch's docs show."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, count))


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("kwargs", [{"batch_size": 3}, {"batch_size": 3, "drop_last": True},
                                    {"batch_size": None}],
                         ids=["partial", "drop_last", "unbatched"])
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_an_iterable_dataset_is_batched_in_each_worker_as_torchs(
        num_workers: int, kwargs: dict[str, Any]) -> None:
    # Each worker batches its own instances, handed over round robin, each worker's partial
    # last batch kept (or dropped); len() is torch's (the dataset's length in batches).
    loaders = [loader(Split(20), num_workers=num_workers, **kwargs) for loader in LOADERS]
    assert len(loaders[1]) == len(loaders[0])
    theirs, ours = (run(loader) for loader in loaders)
    assert ours == theirs


def test_an_iterable_dataset_shuffled_is_read_into_memory_first() -> None:
    # torch refuses shuffle=True here; aioloader reads the dataset into memory and shuffles
    # all of it (no torch script can observe the difference: torch would not run it).
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        tud.DataLoader(Split(4), shuffle=True)
    loader = aioloader.DataLoader(Split(40), batch_size=40, shuffle=True, num_workers=2)
    (batch,) = run(loader)
    assert sorted(batch[2]) == list(range(40)) and batch[2] != list(range(40))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_second_iter_starts_over_and_the_first_says_so(num_workers: int) -> None:
    for loader_type in LOADERS:
        loader = loader_type(range(6), batch_size=2, num_workers=num_workers)
        first = iter(loader)
        assert next(first).tolist() == [0, 1]
        second = iter(loader)
        assert [b.tolist() for b in second] == [[0, 1], [2, 3], [4, 5]]  # a new epoch
        if loader_type is aioloader.DataLoader:
            # torch's first iterator goes on with workers of its own; ours was stopped by
            # the second, and says so (never a hang, never a silent end).
            with pytest.raises(aioloader.LoaderBusyError, match="superseded"):
                next(first)
            loader.close()


async def test_a_second_async_for_starts_over() -> None:
    loader = aioloader.DataLoader(range(6), batch_size=2, num_workers=2)
    first = aiter(loader)
    assert (await anext(first)).tolist() == [0, 1]
    assert [b.tolist() async for b in loader] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(aioloader.LoaderBusyError, match="superseded"):
        await anext(first)
    await loader.aclose()


class Counted(tud.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _inits(path: str) -> list[str]:
    """The worker ids whose worker_init_fn ran, sorted."""
    with open(path) as f:
        return sorted(f.read().split())


def _count_init(path: str) -> Any:
    def init(worker_id: int) -> None:
        with open(path, "a") as f:
            f.write(f"{worker_id}\n")
    return init


@pytest.mark.parametrize("leave", ["break", "raise", "zip"])
def test_persistent_workers_survive_an_epoch_left_early(tmp_path: Any, leave: str) -> None:
    def broken_epochs(loader: Any) -> list[Any]:
        for _ in range(3):
            if leave == "zip":
                list(zip(range(2), loader, strict=False))
                continue
            try:
                for i, _batch in enumerate(loader):
                    if i == 1:
                        if leave == "raise":
                            raise KeyError("the training step failed")
                        break
            except KeyError:
                pass
        return run(loader)  # a whole epoch after them

    outcomes = []
    for n, loader_type in enumerate(LOADERS):
        path = str(tmp_path / f"inits{n}")
        loader = loader_type(Counted(), batch_size=4, num_workers=2, persistent_workers=True,
                             worker_init_fn=_count_init(path))
        outcomes.append((broken_epochs(loader), _inits(path)))
    assert outcomes[1] == outcomes[0]
    assert outcomes[1][1] == ["0", "1"]  # worker_init_fn once per worker


async def test_persistent_workers_survive_an_async_for_left_early(tmp_path: Any) -> None:
    path = str(tmp_path / "inits")
    loader = aioloader.DataLoader(Counted(), batch_size=4, num_workers=2,
                                  persistent_workers=True, worker_init_fn=_count_init(path))
    for _ in range(3):
        async for _batch in loader:
            break
    got = [b.tolist() async for b in loader]
    assert got == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert _inits(path) == ["0", "1"]
    await loader.aclose()


def test_without_persistent_workers_an_epoch_left_early_stops_them(tmp_path: Any) -> None:
    path = str(tmp_path / "inits")
    loader = aioloader.DataLoader(Counted(), batch_size=4, num_workers=2,
                                  worker_init_fn=_count_init(path))
    for _ in range(2):
        for _batch in loader:
            break
    assert len(run(loader)) == 10
    assert len(_inits(path)) == 6  # as torch's: workers per iterator


class Unsplit(Split):
    """Reads itself whole in every worker: more batches than its len() says."""

    def __iter__(self) -> Any:
        return iter(range(self.n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_past_its_length_warns_as_torchs(num_workers: int) -> None:
    # torch compares the batches handed over with the dataset's own len(): with 2 workers
    # reading 4 instances each in batches of 1, the 5th batch is past it.
    for loader_type in LOADERS:
        loader = loader_type(Unsplit(4), batch_size=1, num_workers=num_workers)
        assert len(loader) == 4
        if num_workers:
            with pytest.warns(UserWarning, match="Length of IterableDataset .* was reported "
                                                 "to be 4.*but 5 samples"):
                assert len(run(loader)) == 8
        else:
            assert len(run(loader)) == 4


class BadSamples(tud.Dataset[torch.Tensor]):
    """Items 3 and 7 raise, as a corrupt file would."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in (3, 7):
            raise KeyError(f"bad sample {i}")
        return torch.tensor(i)


def _skipping_errors(it: Any) -> list[Any]:
    """What a torch user's loop that skips failed batches sees."""
    got: list[Any] = []
    while True:
        try:
            got.append(next(it).tolist())
        except StopIteration:
            return got
        except KeyError as err:
            got.append(f"KeyError: {'bad sample 3' in str(err) or 'bad sample 7' in str(err)}")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_leaves_the_iterator_usable_as_torchs(num_workers: int) -> None:
    outcomes = []
    for loader_type in LOADERS:
        loader = loader_type(BadSamples(), batch_size=2, num_workers=num_workers)
        outcomes.append(_skipping_errors(iter(loader)))
        if isinstance(loader, aioloader.DataLoader):
            loader.close()
    assert outcomes[1] == outcomes[0] == [
        [0, 1], "KeyError: True", [4, 5], "KeyError: True", [8, 9]]


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_an_error_leaves_async_for_usable(num_workers: int) -> None:
    loader = aioloader.DataLoader(BadSamples(), batch_size=2, num_workers=num_workers)
    it = aiter(loader)
    got: list[Any] = []
    while True:
        try:
            got.append((await anext(it)).tolist())
        except StopAsyncIteration:
            break
        except KeyError:
            got.append("KeyError")
    assert got == [[0, 1], "KeyError", [4, 5], "KeyError", [8, 9]]
    await loader.aclose()


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"num_workers": -1}, ValueError, "num_workers option should be non-negative"),
    ({"timeout": -1}, ValueError, "timeout option should be non-negative"),
    ({"batch_size": None, "drop_last": True}, ValueError,
     "batch_size=None option disables auto-batching and is mutually exclusive"),
    ({"num_workers": 0, "multiprocessing_context": "spawn"}, ValueError,
     r"multi-process loading \(num_workers > 0\), but got"),
    ({"num_workers": 1, "multiprocessing_context": "bad"}, ValueError,
     "should specify a valid start method in"),
    ({"num_workers": 1, "multiprocessing_context": object()}, TypeError,
     "multiprocessing_context option should be a valid context "),
    ({"batch_size": 11, "sampler": range(3), "shuffle": True}, ValueError,
     "sampler option is mutually exclusive with shuffle"),
    ({"batch_sampler": [[0]], "sampler": range(3), "shuffle": True}, ValueError,
     "sampler option is mutually exclusive with shuffle"),
    ({"batch_sampler": [[0]], "drop_last": True}, ValueError,
     "batch_sampler option is mutually exclusive with"),
])
def test_refusals_say_what_torchs_say(kwargs: dict[str, Any], error: type[Exception],
                                      words: str) -> None:
    # torch's own test suite matches these words; ours go on to say what to do.
    for loader in LOADERS:
        with pytest.raises(error, match=words):
            loader(Squares(), **kwargs)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"sampler": range(3)}, "expected unspecified sampler"),
    ({"batch_sampler": [[0]]}, "expected unspecified batch_sampler"),
])
def test_an_iterable_datasets_refusals_say_what_torchs_say(kwargs: dict[str, Any],
                                                           words: str) -> None:
    for loader in LOADERS:
        with pytest.raises(ValueError, match=f"DataLoader with IterableDataset: {words}"):
            loader(Split(4), **kwargs)


def test_a_timeout_says_what_torchs_says() -> None:
    class Stuck(tud.Dataset[int]):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            import time

            time.sleep(30)  # the silence under test; the loader is closed long before
            return i

    loader = aioloader.DataLoader(Stuck(), num_workers=1, timeout=1)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after \d+ seconds"):
        next(iter(loader))
    loader.close()


def test_allennlps_form_with_a_none_data_path_is_accepted_for_a_dataset() -> None:
    # DataLoader(dataset, None, batch_size=4): AllenNLP's (source, data_path) form, which the
    # contract's readers use; torch refuses it, so no torch script means anything else.
    with pytest.raises(TypeError, match="multiple values for argument 'batch_size'"):
        tud.DataLoader(Squares(), None, batch_size=4)
    loader = aioloader.DataLoader(Squares(), None, batch_size=4)
    assert (loader.batch_size, len(loader)) == (4, 6)
    with pytest.raises(TypeError, match="multiple values for argument 'batch_size'"):
        aioloader.DataLoader(Squares(), 2, batch_size=4)
