"""Every constructor argument is checked when the loader is built (issue 19): TypeError for a
wrong type, ValueError for a wrong value, each message naming the argument and what it got;
torch's positional batch size is called out. Nothing here starts a worker."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import aioloader


class Numbers(aioloader.Reader):
    def read(self, data_path: Any) -> Iterator[int]:
        yield from range(8)


class Stream(tud.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


def build(source: Any = None, *args: Any, **kwargs: Any) -> aioloader.DataLoader:
    kwargs.setdefault("quiet", True)
    if "batch_sampler" not in kwargs:
        kwargs.setdefault("batch_size", 2)
    return aioloader.DataLoader(list(range(8)) if source is None else source, *args, **kwargs)


WORKERS = {"num_workers": 1}  # fork: no process starts before the first epoch
KEYED = {"load_fn": str}  # a load stage, for its options

# (argument, bad value, other arguments it needs)
WRONG_TYPES: list[tuple[str, Any, dict[str, Any]]] = [
    ("batch_size", "4", {}),
    ("batch_size", 2.0, {}),
    ("batch_size", True, {}),
    ("drop_last", 1, {}),
    ("drop_last", "yes", {}),
    ("shuffle", "yes", {}),
    ("batch_sampler", 42, {"batch_size": None}),
    ("batch_sampler", "0123", {"batch_size": None}),
    ("batches_per_epoch", 1.5, {}),
    ("batches_per_epoch", True, {}),
    ("num_workers", 1.5, {}),
    ("num_workers", "2", {}),
    ("num_workers", True, {}),
    ("max_instances_in_memory", 8.0, {}),
    ("max_instances_in_memory", True, {}),
    ("start_method", 3, {}),
    ("worker_type", None, {}),
    ("worker_nice", 2.0, WORKERS),
    ("worker_nice", True, WORKERS),
    ("cuda_device", 1.5, {}),
    ("cuda_device", True, {}),
    ("quiet", "no", {}),
    ("collate_fn", 42, {}),
    ("collate_fn", "default", {}),
    ("seed", 1.0, {}),
    ("seed", "7", {}),
    ("seed", True, {}),
    ("timeout", "3", {}),
    ("timeout", True, {}),
    ("prefetch", 2.5, {}),
    ("prefetch", True, {}),
    ("even_batches", 1, {}),
    ("zero_copy", "yes", {}),
    ("max_worker_restarts", 1.5, {}),
    ("max_worker_restarts", True, {}),
    ("max_batches_per_worker", 2.5, {}),
    ("max_batches_per_worker", True, {}),
    ("max_worker_rss", "1G", {}),
    ("max_worker_rss", True, {}),
    ("log_every", "1", {}),
    ("log_every", True, {}),
    ("load_fn", "fetch", {}),
    ("concurrency", 4.0, KEYED),
    ("concurrency", True, KEYED),
    ("ordered", "no", KEYED),
    ("retries", "3", KEYED),
    ("retries", 1.0, KEYED),
    ("on_error", 0, KEYED),
    ("sampler", 42, {}),
    ("sampler", "0123", {}),
    ("worker_init_fn", 42, WORKERS),
    ("persistent_workers", 0, WORKERS),
    ("prefetch_factor", 2.0, WORKERS),
    ("prefetch_factor", True, WORKERS),
    ("generator", 7, {}),
    ("in_order", "yes", {}),
    ("multiprocessing_context", 3, WORKERS),
    ("pin_memory", "yes", {}),
    ("pin_memory_device", 0, {}),
]


@pytest.mark.parametrize(("name", "value", "extra"), WRONG_TYPES,
                         ids=[f"{n}={v!r}" for n, v, _ in WRONG_TYPES])
def test_a_wrong_type_is_a_type_error_naming_the_argument(
        name: str, value: Any, extra: dict[str, Any]) -> None:
    with pytest.raises(TypeError) as caught:
        build(**{**extra, name: value})
    message = str(caught.value)
    # ours, or torch's own words where its test suite matches them (issue 32)
    assert message.startswith((f"{name} must be", f"{name} option should")), message
    assert repr(value) in message and f"({type(value).__name__})" in message, message
    # What these checks raised before issue 19 (ValueError) still catches them.
    assert isinstance(caught.value, ValueError)


WRONG_VALUES: list[tuple[str, Any, dict[str, Any]]] = [
    ("batch_size", 0, {}),
    ("batch_size", -4, {}),
    ("batches_per_epoch", 0, {}),
    ("num_workers", -1, {}),
    ("max_instances_in_memory", 0, {}),
    ("start_method", "threads", {}),
    ("start_method", "Fork", {}),
    ("worker_type", "fiber", {}),
    ("worker_nice", 20, WORKERS),
    ("worker_nice", -1, WORKERS),
    ("cuda_device", "nope", {}),
    ("timeout", -1, {}),
    ("timeout", math.nan, {}),
    ("prefetch", 0, {}),
    ("max_worker_restarts", -1, {}),
    ("max_batches_per_worker", 0, {}),
    ("max_worker_rss", 0, {}),
    ("log_every", 0, {}),
    ("log_every", -0.5, {}),
    ("concurrency", 0, KEYED),
    ("retries", -1, KEYED),
    ("on_error", "ignore", KEYED),
    ("prefetch_factor", 0, WORKERS),
    ("multiprocessing_context", "threads", WORKERS),
]


@pytest.mark.parametrize(("name", "value", "extra"), WRONG_VALUES,
                         ids=[f"{n}={v!r}" for n, v, _ in WRONG_VALUES])
def test_a_wrong_value_is_a_value_error_naming_the_argument(
        name: str, value: Any, extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as caught:
        build(**{**extra, name: value})
    assert not isinstance(caught.value, TypeError)
    message = str(caught.value)
    assert message.startswith((f"{name} must be", f"{name} option should")), message
    assert repr(value) in message, message


def test_an_unreadable_source_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot read from 'int'"):
        build(42)


@pytest.mark.parametrize(("source", "second"), [
    (list(range(8)), 4), (Stream(), 4), (list(range(8)), np.int64(4)),
], ids=["map-style", "iterable", "numpy"])
def test_a_datasets_second_positional_argument_is_torchs_batch_size(source: Any,
                                                                    second: Any) -> None:
    # torch's DataLoader(dataset, 4): the dataset form is torch's, positional order included.
    assert aioloader.DataLoader(source, second).batch_size == 4
    for loader in (tud.DataLoader, aioloader.DataLoader):
        with pytest.raises(TypeError, match="multiple values for argument 'batch_size'"):
            loader(source, second, batch_size=2)


def test_a_readers_second_positional_argument_is_its_data_path() -> None:
    # AllenNLP's form: DataLoader(reader, data_path); batch_size is torch's 1 by default.
    loader = aioloader.DataLoader(Numbers(), 4)
    assert (loader.data_path, loader.batch_size) == (4, 1)
    with pytest.raises(TypeError, match="at most 2 positional arguments for a reader"):
        aioloader.DataLoader(Numbers(), None, 4)


# (argument, numpy value, the attribute that keeps it, other arguments it needs)
NUMPY_INTS: list[tuple[str, Any, str, dict[str, Any]]] = [
    ("batch_size", np.int64(4), "batch_size", {}),
    ("batches_per_epoch", np.int32(2), "batches_per_epoch", {}),
    ("num_workers", np.int64(0), "num_workers", {}),
    ("num_workers", np.int8(1), "num_workers", {}),
    ("max_instances_in_memory", np.uint16(4), "max_instances_in_memory", {}),
    ("seed", np.int64(7), "seed", {}),
    ("prefetch", np.int64(3), "prefetch", {}),
    ("prefetch_factor", np.int64(3), "prefetch", WORKERS),
    ("max_worker_restarts", np.int64(1), "max_worker_restarts", {}),
    ("max_batches_per_worker", np.int64(5), "max_batches_per_worker", {}),
    ("max_worker_rss", np.int64(1 << 30), "max_worker_rss", {}),
    ("worker_nice", np.int64(5), "worker_nice", WORKERS),
    ("concurrency", np.int64(3), "concurrency", KEYED),
    ("retries", np.int64(2), "retries", KEYED),
]


@pytest.mark.parametrize(("name", "value", "attribute", "extra"), NUMPY_INTS,
                         ids=[f"{n}={type(v).__name__}" for n, v, _, _ in NUMPY_INTS])
def test_numpy_integers_are_taken_as_ints(name: str, value: Any, attribute: str,
                                          extra: dict[str, Any]) -> None:
    with build(**{**extra, name: value}) as loader:
        kept = getattr(loader, attribute)
        assert kept == int(value) and type(kept) is int


def test_a_numpy_cuda_device_is_taken_as_an_int() -> None:
    assert build(cuda_device=np.int64(-1))._device is None  # AllenNLP's "the CPU"
    assert build(cuda_device=np.int64(0))._device == torch.device("cuda", 0)


@pytest.mark.parametrize(("kwargs", "attribute", "kept"), [
    ({"shuffle": None}, "shuffle", False),  # torch's default
    ({"batch_sampler": tud.BatchSampler(range(8), 3, False), "shuffle": None}, "shuffle",
     False),
    ({"timeout": 0}, "timeout", None),  # torch's default: no timeout
    ({"timeout": 0.0}, "timeout", None),
    ({"timeout": 5}, "timeout", 5),
    ({"quiet": None}, "quiet", None),
    ({"batch_sampler": [[0, 1], [2, 3]]}, "batch_sampler", [[0, 1], [2, 3]]),
    ({"cuda_device": "meta"}, "_device", torch.device("meta")),
    ({"seed": -3}, "seed", -3),
    ({"multiprocessing_context": "spawn", "start_method": "spawn", **WORKERS}, "start_method",
     "spawn"),
], ids=["shuffle-None", "shuffle-None-batch_sampler", "timeout-0", "timeout-0.0",
        "timeout-5", "quiet-None", "batch_sampler-lists", "cuda_device-meta", "seed-negative",
        "context"])
def test_valid_values_are_kept(kwargs: dict[str, Any], attribute: str, kept: Any) -> None:
    with build(**kwargs) as loader:
        assert getattr(loader, attribute) == kept
