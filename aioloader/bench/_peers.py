"""The loaders aioloader is measured against: torch's DataLoader, SPDL pipelines, torchdata.

Each peer is written the way its documentation shows, given the same dataset, batch size,
collate, worker count and (where it starts processes) start method. Opening one gives an
iterable that yields one epoch per ``iter()``; leaving the block stops its workers.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import Dataset, default_collate

from ._workloads import Collate, Sample

TORCH = "torch"
SPDL_THREAD = "spdl-thread"
SPDL_PROCESS = "spdl-process"
STATEFUL = "tdl-stateful"  # torchdata.stateful_dataloader.StatefulDataLoader
NODES = "tdl-nodes"  # torchdata.nodes: ParallelMapper(method="process") over index batches
PEERS = (SPDL_THREAD, SPDL_PROCESS, STATEFUL, NODES)  # what --peers adds, in this order
_MODULES = {SPDL_THREAD: "spdl.pipeline", SPDL_PROCESS: "spdl.pipeline",
            STATEFUL: "torchdata.stateful_dataloader", NODES: "torchdata.nodes"}


@dataclass(frozen=True)
class Setup:
    """What every loader of one measurement shares."""

    batch_size: int
    num_workers: int
    start_method: str
    collate: Collate | None  # None: the loader's own default (torch's default_collate)


Opener = Callable[[Dataset[Sample], Setup], AbstractContextManager[Iterable[Any]]]


def available(num_workers: int) -> tuple[tuple[str, ...], list[str]]:
    """The peers that can run here, and a line for each one left out."""
    found: list[str] = []
    notes: list[str] = []
    for peer in PEERS:
        module = _MODULES[peer]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            notes.append(f"{peer}: skipped, {module} is not installed ({exc})")
            continue
        if peer == SPDL_PROCESS and num_workers == 0:
            notes.append(f"{peer}: skipped at --num-workers 0 (a process pool needs workers)")
            continue
        found.append(peer)
    return tuple(found), notes


def open_loader(side: str, dataset: Dataset[Sample], setup: Setup
                ) -> AbstractContextManager[Iterable[Any]]:
    """The loader of ``side`` (torch or one of ``PEERS``) over ``dataset``."""
    # torchdata 0.11 warns on every iterator under torch >= 2.9 (torch.set_vital is deprecated)
    warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
    return _OPENERS[side](dataset, setup)


def torch_loader(dataset: Dataset[Sample], setup: Setup,
                 cls: Any = torch.utils.data.DataLoader) -> Any:
    """torch's DataLoader (or a drop-in of it), workers kept across epochs."""
    workers = setup.num_workers
    return cls(dataset, batch_size=setup.batch_size, num_workers=workers,
               collate_fn=setup.collate, persistent_workers=workers > 0,
               multiprocessing_context=setup.start_method if workers > 0 else None)


@contextmanager
def _torch_like(dataset: Dataset[Sample], setup: Setup, cls: Any) -> Iterator[Iterable[Any]]:
    loader = torch_loader(dataset, setup, cls)
    try:
        yield loader
    finally:
        del loader  # the caller dropped its reference: the persistent workers stop with it
        gc.collect()


def _torch(dataset: Dataset[Sample], setup: Setup) -> AbstractContextManager[Iterable[Any]]:
    return _torch_like(dataset, setup, torch.utils.data.DataLoader)


def _stateful(dataset: Dataset[Sample], setup: Setup) -> AbstractContextManager[Iterable[Any]]:
    # imported by name: torchdata is optional and ships no type information
    cls = importlib.import_module("torchdata.stateful_dataloader").StatefulDataLoader
    return _torch_like(dataset, setup, cls)


class _Fetch:
    """Index batch -> collated batch: the one op of the SPDL and torchdata.nodes pipelines.

    In a worker process (``in_worker``) torch runs single-threaded, as torch's DataLoader
    makes its workers (torch/utils/data/_utils/worker.py): left at the default, every worker
    runs a thread per core for each copy (with fork, image-alloc on 2 cores: spdl-process
    9 batches/s instead of 66).
    """

    def __init__(self, dataset: Dataset[Sample], collate: Collate | None,
                 in_worker: bool = False) -> None:
        self.dataset = dataset
        self.collate = collate or default_collate
        self.in_worker = in_worker

    def __call__(self, indices: list[int]) -> Any:
        if self.in_worker and torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        return self.collate([self.dataset[i] for i in indices])


def _length(dataset: Dataset[Sample]) -> int:
    return len(dataset)  # type: ignore[arg-type]  # the workloads' datasets are sized


def _index_batches(dataset: Dataset[Sample], batch_size: int) -> list[list[int]]:
    n = _length(dataset)
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


# A process pool's workers get the op once, from the initializer, and then only indices, as
# spdl.dataloader's own PyTorch loader does (spdl/dataloader/_pytorch_dataloader.py).
_WORKER_FETCH: _Fetch | None = None


def _init_worker(fetch: _Fetch) -> None:
    global _WORKER_FETCH
    _WORKER_FETCH = fetch


def _fetch_in_worker(indices: list[int]) -> Any:
    assert _WORKER_FETCH is not None, "the pool's initializer did not run"
    return _WORKER_FETCH(indices)


class _SpdlEpochs:
    """One ``spdl.pipeline`` per epoch: index batches -> fetch+collate, in input order -> sink.

    The executor (None: the pipeline's own thread pool) outlives the epochs, as workers do in
    the other loaders.
    """

    def __init__(self, batches: list[list[int]], op: Callable[[list[int]], Any],
                 concurrency: int, executor: Any, threads: int) -> None:
        self.batches, self.op, self.executor = batches, op, executor
        self.concurrency, self.threads = concurrency, threads

    def __iter__(self) -> Iterator[Any]:
        builder = importlib.import_module("spdl.pipeline").PipelineBuilder
        pipeline = (builder()
                    .add_source(self.batches)
                    .pipe(self.op, concurrency=self.concurrency, executor=self.executor,
                          output_order="input")
                    .add_sink()
                    .build(num_threads=self.threads))
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()


@contextmanager
def _spdl_thread(dataset: Dataset[Sample], setup: Setup) -> Iterator[Iterable[Any]]:
    # num_workers=0 has no thread-free form here: one thread is the nearest
    workers = max(1, setup.num_workers)
    yield _SpdlEpochs(_index_batches(dataset, setup.batch_size), _Fetch(dataset, setup.collate),
                      concurrency=workers, executor=None, threads=workers)


@contextmanager
def _spdl_process(dataset: Dataset[Sample], setup: Setup) -> Iterator[Iterable[Any]]:
    from concurrent.futures import ProcessPoolExecutor

    executor = ProcessPoolExecutor(
        max_workers=setup.num_workers, mp_context=multiprocessing.get_context(setup.start_method),
        initializer=_init_worker, initargs=(_Fetch(dataset, setup.collate, in_worker=True),))
    with executor:
        yield _SpdlEpochs(_index_batches(dataset, setup.batch_size), _fetch_in_worker,
                          concurrency=setup.num_workers, executor=executor, threads=1)


@contextmanager
def _nodes(dataset: Dataset[Sample], setup: Setup) -> Iterator[Iterable[Any]]:
    """torchdata's migration guide's pipeline: sampler -> batcher -> ParallelMapper(fetch and
    collate, processes, in order) -> prefetcher -> Loader."""
    tn = importlib.import_module("torchdata.nodes")
    workers = setup.num_workers
    sampler = torch.utils.data.SequentialSampler(range(_length(dataset)))
    node = tn.Batcher(tn.SamplerWrapper(sampler), batch_size=setup.batch_size, drop_last=False)
    node = tn.ParallelMapper(node, map_fn=_Fetch(dataset, setup.collate, in_worker=workers > 0),
                             num_workers=workers,
                             in_order=True, method="process",
                             multiprocessing_context=setup.start_method if workers else None)
    if workers > 0:  # with none, everything stays in this thread, as torch's loader does
        node = tn.Prefetcher(node, prefetch_factor=2 * workers)
    loader = tn.Loader(node)
    try:
        yield loader
    finally:
        del loader, node  # the caller dropped its reference: the iterators' workers stop
        gc.collect()


_OPENERS: dict[str, Opener] = {TORCH: _torch, SPDL_THREAD: _spdl_thread,
                               SPDL_PROCESS: _spdl_process, STATEFUL: _stateful, NODES: _nodes}
