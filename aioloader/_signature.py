"""The DataLoader's two call forms, bound to named arguments: torch's for a dataset, AllenNLP's
for a reader.

A torch ``Dataset`` or ``IterableDataset`` (or anything torch's ``DataLoader`` takes as
one: an object with ``__getitem__`` and ``__len__``) is called as torch calls it:
``DataLoader(dataset, batch_size=1, shuffle=None, sampler=None, ...)``, torch's positional
order and defaults, ``dataset=`` by name too. A reader (an object with ``read(data_path)``)
keeps AllenNLP's form ``DataLoader(reader, data_path=None, *, ...)``. Which form applies
follows from the first argument alone, as the two overloads of ``DataLoader.__init__`` tell
a type checker; nothing else is guessed (issue 32).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypedDict

import torch

from .pipeline._loads import Retry
from .plane._device import DeviceLike
from .plans._sources import Kind, classify


class LoaderOptions(TypedDict, total=False):
    """aioloader's own options, keyword-only in both forms (docs/api.md)."""

    batches_per_epoch: int | None
    max_instances_in_memory: int | None
    start_method: str
    worker_type: str
    ray_options: dict[str, Any] | None
    worker_nice: int | None
    cuda_device: DeviceLike | None
    quiet: bool | None
    seed: int | None
    prefetch: int | None
    fetch_on_loop: bool
    even_batches: bool
    zero_copy: bool
    max_worker_restarts: int
    max_batches_per_worker: int | None
    max_worker_rss: int | None
    log_every: float | None
    load_fn: Callable[[Any], Any] | None
    concurrency: int | None
    ordered: bool
    retries: int | Retry
    on_error: str


class ReaderOptions(LoaderOptions, total=False):
    """A reader's keywords: torch's arguments by name, and aioloader's own."""

    batch_size: int | None
    shuffle: bool | None
    sampler: Any
    batch_sampler: Any
    num_workers: int
    collate_fn: Callable[[list[Any]], Any] | None
    pin_memory: bool
    drop_last: bool
    timeout: float | None
    worker_init_fn: Callable[[int], object] | None
    multiprocessing_context: Any
    generator: torch.Generator | None
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory_device: str
    in_order: bool

# torch 2.13's DataLoader.__init__, in its positional order, with its defaults.
TORCH_POSITIONAL: tuple[tuple[str, Any], ...] = (
    ("batch_size", 1),
    ("shuffle", None),
    ("sampler", None),
    ("batch_sampler", None),
    ("num_workers", 0),
    ("collate_fn", None),
    ("pin_memory", False),
    ("drop_last", False),
    ("timeout", 0),
    ("worker_init_fn", None),
    ("multiprocessing_context", None),
    ("generator", None),
)
READER_POSITIONAL: tuple[tuple[str, Any], ...] = (("data_path", None),)

# Keyword-only in both forms (torch's own keyword-only ones first), with their defaults.
# ``persistent_workers`` is torch's False for a dataset; a reader's workers stay (True).
KEYWORD_ONLY: dict[str, Any] = {
    "prefetch_factor": None,
    "persistent_workers": None,
    "pin_memory_device": "",
    "in_order": True,
    "data_path": None,
    "batches_per_epoch": None,
    "max_instances_in_memory": None,
    "start_method": "fork",
    "worker_type": "process",
    "ray_options": None,
    "worker_nice": None,
    "cuda_device": None,
    "quiet": None,
    "seed": None,
    "prefetch": None,
    "fetch_on_loop": False,
    "even_batches": True,
    "zero_copy": True,
    "max_worker_restarts": 0,
    "max_batches_per_worker": None,
    "max_worker_rss": None,
    "log_every": None,
    "load_fn": None,
    "concurrency": None,
    "ordered": True,
    "retries": 0,
    "on_error": "raise",
}
NAMES = frozenset(name for name, _ in TORCH_POSITIONAL) | KEYWORD_ONLY.keys()


def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(source, arguments)`` for ``DataLoader(*args, **kwargs)``: every argument by name,
    defaults filled in. ``TypeError`` as Python's own for a missing source, a duplicate, an
    unknown name or too many positional arguments."""
    kwargs = dict(kwargs)
    source_names = [name for name in ("dataset", "reader") if name in kwargs]
    if len(source_names) > 1 or (args and source_names):
        raise TypeError("DataLoader() got multiple values for its source (the dataset or "
                        "reader): pass it once, first or as dataset=/reader=")
    if args:
        source, args = args[0], args[1:]
    elif source_names:
        source = kwargs.pop(source_names[0])
    else:
        raise TypeError("DataLoader() missing 1 required argument: 'dataset' (a torch "
                        "Dataset or IterableDataset) or 'reader' (an object with "
                        "read(data_path))")
    kind = classify(source)
    positional = READER_POSITIONAL if kind is Kind.READER else TORCH_POSITIONAL
    if positional is TORCH_POSITIONAL and args == (None,) and "batch_size" in kwargs:
        # AllenNLP's form for a dataset, DataLoader(dataset, None, batch_size=...): the None
        # is its data_path, which a dataset does not read (torch would refuse the call)
        args = ()
    if len(args) > len(positional):
        form = ("DataLoader(reader, data_path, *, ...)" if positional is READER_POSITIONAL
                else "torch's DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, "
                "num_workers, collate_fn, pin_memory, drop_last, timeout, worker_init_fn, "
                "multiprocessing_context, generator, *, ...)")
        raise TypeError(f"DataLoader() takes at most {len(positional) + 1} positional "
                        f"arguments for a {kind.value} ({form}), "
                        f"{len(args) + 1} were given; pass the others by name")
    given = dict(zip((name for name, _ in positional), args, strict=False))
    if clash := sorted(given.keys() & kwargs.keys()):
        raise TypeError(f"DataLoader() got multiple values for argument {clash[0]!r}")
    if unknown := sorted(kwargs.keys() - NAMES):
        raise TypeError(f"DataLoader() got an unexpected keyword argument {unknown[0]!r}")
    arguments = dict(TORCH_POSITIONAL) | KEYWORD_ONLY | given | kwargs
    if arguments["persistent_workers"] is None:
        arguments["persistent_workers"] = positional is READER_POSITIONAL
    return source, arguments


def torch_form() -> inspect.Signature:
    """The dataset form as one signature, for ``help()`` and ``inspect.signature``."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("dataset", P.POSITIONAL_OR_KEYWORD)]
    # shuffle=False and timeout=None mean what torch's None and 0 mean, and are what the
    # contract's signature says; persistent_workers is a dataset's (torch's) False
    shown = dict(TORCH_POSITIONAL) | {"shuffle": False, "timeout": None}
    keywords = KEYWORD_ONLY | {"persistent_workers": False}
    params += [P(name, P.POSITIONAL_OR_KEYWORD, default=default)
               for name, default in shown.items()]
    params += [P(name, P.KEYWORD_ONLY, default=default) for name, default in keywords.items()]
    return inspect.Signature(params, return_annotation=None)
