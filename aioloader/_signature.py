"""The DataLoader's two call forms, bound to named arguments: torch's for a dataset,
AllenNLP's ``DataLoader(reader, data_path=None, *, ...)`` for a reader; the first argument
alone decides which, as the two overloads of ``DataLoader.__init__`` tell a type checker
(issue 32)."""

from __future__ import annotations

import inspect
from typing import Any

from ._options import ARGUMENTS, LoaderOptions
from .plans._sources import Kind, classify

# Every argument's default (persistent_workers: None, for the form to decide).
DEFAULTS = {name: argument.default for name, argument in ARGUMENTS.items()} | {"data_path": None}
# torch 2.13's DataLoader.__init__, in its order: positional up to prefetch_factor, then
# keyword-only; aioloader's own options are keyword-only in both forms.
TORCH = [name for name in ARGUMENTS if name not in LoaderOptions.__optional_keys__]
TORCH_POSITIONAL = TORCH[:TORCH.index("prefetch_factor")]
KEYWORD_ONLY = [*TORCH[len(TORCH_POSITIONAL):], "data_path",
                *(name for name in ARGUMENTS if name not in TORCH)]


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
    positional = ["data_path"] if kind is Kind.READER else TORCH_POSITIONAL
    if positional is TORCH_POSITIONAL and args == (None,) and "batch_size" in kwargs:
        # AllenNLP's form for a dataset, DataLoader(dataset, None, batch_size=...): the None
        # is its data_path, which a dataset does not read (torch would refuse the call)
        args = ()
    if len(args) > len(positional):
        form = ("DataLoader(reader, data_path, *, ...)" if kind is Kind.READER
                else f"torch's DataLoader(dataset, {', '.join(TORCH_POSITIONAL)}, *, ...)")
        raise TypeError(f"DataLoader() takes at most {len(positional) + 1} positional "
                        f"arguments for a {kind.value} ({form}), "
                        f"{len(args) + 1} were given; pass the others by name")
    given = dict(zip(positional, args, strict=False))
    if clash := sorted(given.keys() & kwargs.keys()):
        raise TypeError(f"DataLoader() got multiple values for argument {clash[0]!r}")
    if unknown := sorted(kwargs.keys() - DEFAULTS.keys()):
        raise TypeError(f"DataLoader() got an unexpected keyword argument {unknown[0]!r}")
    arguments = DEFAULTS | given | kwargs
    if arguments["persistent_workers"] is None:
        arguments["persistent_workers"] = kind is Kind.READER
    return source, arguments


def torch_form() -> inspect.Signature:
    """The dataset form as one signature, for ``help()`` and ``inspect.signature``."""
    P = inspect.Parameter
    # shuffle=False and timeout=None mean what torch's None and 0 mean, and are what the
    # contract's signature says; persistent_workers is a dataset's (torch's) False
    shown = DEFAULTS | {"shuffle": False, "timeout": None, "persistent_workers": False}
    return inspect.Signature(
        [P("self", P.POSITIONAL_OR_KEYWORD), P("dataset", P.POSITIONAL_OR_KEYWORD)]
        + [P(name, P.POSITIONAL_OR_KEYWORD, default=shown[name]) for name in TORCH_POSITIONAL]
        + [P(name, P.KEYWORD_ONLY, default=shown[name]) for name in KEYWORD_ONLY],
        return_annotation=None)
