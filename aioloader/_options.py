"""The DataLoader's options, each declared once (its type, default and check: a row of
``LoaderOptions``/``ReaderOptions``), then the rules between them; ``_config.build_config``
runs them before anything is read or started (issue 19)."""

from __future__ import annotations

import importlib.util
import numbers
import operator
import os
import reprlib
import warnings
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, NamedTuple, TypedDict, get_type_hints

import torch

from ._errors import ArgumentTypeError
from .pipeline._loads import LoadOptions, Retry
from .plane._device import DeviceLike, as_device
from .plans._samplers import BatchSampler
from .plans._sources import Kind

START_METHODS = ("fork", "spawn", "forkserver")
WORKER_TYPES = ("process", "thread", "ray")
RAY_MISSING = ("worker_type='ray' needs Ray, which is not installed: pip install -e '.[ray]' "
               "in a clone of aioloader (or pip install ray==2.60.0), or use "
               "worker_type='process'")
# Actor options that aioloader sets itself (see _ray.py): a dead actor is healed from the
# consumer's position (max_worker_restarts); Ray replaying its calls would deliver twice.
RAY_RESERVED = ("max_restarts", "max_task_retries", "max_concurrency", "concurrency_groups")
DEFAULT_PREFETCH = 4
FULL_NICE = 19  # worker_nice's default where worker processes fill every core (issue 23)


def check_each(kind: Kind, data_path: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """Each argument alone, by its row: ``TypeError`` (:class:`ArgumentTypeError`) for a
    wrong type, ``ValueError`` for a wrong value, each message naming the argument, what it
    got and what it takes. Returns them as the loader keeps them (a numpy integer as an int,
    torch's ``timeout=0`` and ``shuffle=None`` as ours, ``cuda_device`` as a device)."""
    _dataset_data_path(data_path, kind)
    checked = dict(arguments)
    for name, argument in ARGUMENTS.items():
        value = arguments.get(name, argument.default)
        checked[name] = value if argument.check is None else argument.check(name, value)
    return checked


def check_rules(kind: Kind, a: dict[str, Any]) -> None:
    """The rules between arguments (``a``: as :func:`check_each` returned them); torch's
    ``multiprocessing_context`` and ``prefetch_factor`` become ``start_method`` and
    ``prefetch`` in ``a``."""
    a["start_method"] = _start_method(a["start_method"], a["multiprocessing_context"],
                                      a["num_workers"])
    a["prefetch"] = _prefetch_of(a["prefetch"], a["prefetch_factor"], a["num_workers"])
    _torch_samplers(kind, a["sampler"], a["shuffle"], a["batch_sampler"])
    _batching(a)
    _ray_rules(a["worker_type"], a["ray_options"])
    if a["fetch_on_loop"] and a["num_workers"] > 0:
        raise ValueError(
            f"fetch_on_loop=True runs num_workers=0 fetches on the caller's loop; with "
            f"num_workers={a['num_workers']} the workers fetch. Drop fetch_on_loop, or use "
            "num_workers=0")
    _process_only(a)
    _worker_number(a["num_workers"], a["worker_type"])
    a["worker_nice"] = validate_worker_nice(a["worker_nice"], num_workers=a["num_workers"],
                                            worker_type=a["worker_type"])


def check_load_rules(loads: LoadOptions | None, a: dict[str, Any]) -> None:
    """The rules between the load stage (``loads``) and the other arguments."""
    if loads is None or loads.ordered:
        return
    if a["max_batches_per_worker"] or a["max_worker_rss"]:
        raise ValueError(
            "ordered=False cannot be combined with max_batches_per_worker or "
            "max_worker_rss: a retiring worker hands over at a block boundary, and loads "
            "that finish out of order leave none. Use ordered=True (loads still overlap; "
            "only the hand-over order is kept), or max_worker_restarts (a replacement goes "
            "on from the keys delivered)")


def validate_worker_nice(nice: Any, *, num_workers: int, worker_type: str) -> int:
    """``worker_nice`` as an int from 0 to 19, for a loader that has worker processes; None
    (the default) as DataLoader's docstring says."""
    if nice is None:
        fills = worker_type == "process" and num_workers >= usable_cores()
        return FULL_NICE if fills else 0
    checked = _int("worker_nice", nice, "an int from 0 to 19 (added to each worker process's "
                   "niceness with os.nice), or None", least=0, most=19)
    if checked and (num_workers == 0 or worker_type != "process"):
        raise ValueError(
            f"worker_nice={checked} applies to worker processes, and this loader has none "
            f"({'num_workers=0' if num_workers == 0 else 'worker_type=' + repr(worker_type)}"
            "): its work runs in this process, at this process's priority. Leave "
            "worker_nice unset, or use worker processes")
    return checked


def _worker_number(num_workers: int, worker_type: str) -> None:
    """torch's warning for more workers than this process may use cores (its
    ``check_worker_number_rationality``); Ray's workers run wherever Ray places them."""
    cores = usable_cores()
    if worker_type != "ray" and num_workers > cores:
        warnings.warn(
            f"This DataLoader will create {num_workers} worker processes in total. Our "
            f"suggested max number of worker in current system is {cores}, which is smaller "
            "than what this DataLoader is going to create. Please be aware that excessive "
            "worker creation might get DataLoader running slow or even freeze, lower the "
            "worker number to avoid potential slowness/freeze if necessary.", stacklevel=5)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as taskset and Slurm set it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ---------------------------------------------------------------- one argument

Check = Callable[[str, Any], Any]


class Arg(NamedTuple):
    """An option's default and its check alone, ``(name, value) -> the value as kept``
    (None: checked with the others, in :func:`check_rules`)."""

    default: Any
    check: Check | None = None


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _got(value: Any) -> str:
    """What an argument got, as its messages say it: ``'4' (str)``."""
    return f"{_REPR.repr(value)} ({type(value).__name__})"


def _int_like(value: Any) -> bool:
    """An int or what stands for one (a numpy integer: ``operator.index``); not a bool."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _int(name: str, value: Any, what: str, *, least: int | None,
         most: int | None = None) -> int:
    if not _int_like(value):
        raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
    n = operator.index(value)
    if (least is not None and n < least) or (most is not None and n > most):
        raise ValueError(f"{name} must be {what}, got {_got(value)}")
    return n


def _ints(what: str, *, least: int | None = 1) -> Check:
    return partial(_int, what=what, least=least)


def _or_none(check: Check) -> Check:
    def optional(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)
    return optional


def _is(what: str, test: type | Callable[[Any], bool]) -> Check:
    """A check of what a value is (:class:`ArgumentTypeError`): an instance of ``test``, or
    what the ``test`` predicate accepts."""
    def check(name: str, value: Any) -> Any:
        if not (isinstance(value, test) if isinstance(test, type) else test(value)):
            raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
        return value
    return check


# torch refuses a non-bool drop_last too (BatchSampler), numpy's bool_ included.
_FLAG = _is("True or False", bool)


def _shuffle(name: str, value: Any) -> bool:
    """torch's ``shuffle``: None is False, and an int counts by its truth (torch tests
    ``if shuffle:``, so ``shuffle=1`` shuffles and ``shuffle=3`` meets its sampler rules)."""
    if value is None:
        return False
    if _int_like(value):
        return bool(operator.index(value))
    return bool(_is("True, False, None or an int (its truth)", bool)(name, value))


def _num_workers(name: str, value: Any) -> int:
    if _int_like(value) and operator.index(value) < 0:
        raise ValueError(f"num_workers option should be non-negative (as torch says); use "
                         f"num_workers=0 to disable multiprocessing, got {value}")
    return _int(name, value, "an int >= 0 (0: no worker processes)", least=0)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _seconds(name: str, value: Any, what: str) -> float:
    if not _real(value):
        raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
    if not float(value) > 0:  # NaN too
        raise ValueError(f"{name} must be {what}, got {_got(value)}")
    seconds: float = value  # as given: an int stays an int
    return seconds


def _timeout(name: str, value: Any) -> float | None:
    """``timeout`` as given (an int or float stays one); torch's ``timeout=0`` is None."""
    if value is None or (_real(value) and value == 0):
        return None
    if _real(value) and value < 0:
        raise ValueError(f"timeout option should be non-negative (as torch says): a number of "
                         f"seconds, or 0 or None for no timeout; got {value}")
    return _seconds(name, value, "a positive number of seconds, 0 or None (no timeout)")


def _one_of(choices: tuple[str, ...], what: str | None = None) -> Check:
    what = what or f"one of {', '.join(map(repr, choices))}"

    def check(name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
        if value not in choices:
            raise ValueError(f"{name} must be {what}, got {value!r}")
        return value
    return check


def _iterable(value: Any) -> bool:
    return not isinstance(value, (str, bytes)) and hasattr(value, "__iter__")


def _retries(name: str, value: Any) -> int | Retry:
    if isinstance(value, Retry):
        return value
    return _int(name, value, "an int >= 0 or an aioloader.Retry", least=0)


def _device(name: str, cuda_device: Any) -> torch.device | None:
    what = "an int, a str, a torch.device or None"
    device: DeviceLike | None
    if cuda_device is None or isinstance(cuda_device, (str, torch.device)):
        device = cuda_device
    elif _int_like(cuda_device):
        device = operator.index(cuda_device)
    else:
        raise ArgumentTypeError(f"cuda_device must be {what}, got {_got(cuda_device)}")
    try:
        return as_device(device)
    except ValueError as exc:
        raise ValueError(f"cuda_device must be a device torch knows, got {_got(cuda_device)}: "
                         f"{exc.__cause__ or exc}") from exc


def _ray_options(name: str, options: Any) -> dict[str, Any] | None:
    """``ray_options``: keyword arguments of each actor's ``.options()`` (``num_cpus``,
    ``resources``, ``scheduling_strategy``, ``runtime_env``, ...), as a dict of its own."""
    if options is None:
        return None
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ArgumentTypeError(
            "ray_options must be a dict of Ray actor options (such as {'num_cpus': 2, "
            f"'resources': {{'decode': 1}}}}) or None, got {_got(options)}")
    reserved = [k for k in options if k in RAY_RESERVED]
    if reserved:
        raise ValueError(
            f"ray_options cannot set {', '.join(reserved)}: aioloader runs each actor's calls "
            "one at a time, in order, and heals a dead actor itself from the consumer's "
            "position. Use max_worker_restarts=N for restarts")
    return dict(options)


def _dataset_data_path(data_path: Any, kind: Kind) -> None:
    """A dataset reads no ``data_path``: one given is a mistake, never silently dropped."""
    if kind is not Kind.READER and data_path is not None:
        raise ValueError(f"data_path={data_path!r} was given for a {kind.value}, which reads "
                         "no data_path (only a reader's read(data_path) does): leave it out")


_POSITIVE = _or_none(_ints("a positive int or None"))


def _function(signature: str) -> Check:
    return _or_none(_is(f"callable ({signature}) or None", callable))


# ---------------------------------------------------------------- every option, once
# A row per option: its type (what a type checker holds a call to: DataLoader's overloads
# unpack these), its default and its check. torch's are in the order of torch's signature.


class LoaderOptions(TypedDict, total=False):
    """aioloader's own options, keyword-only in both forms (docs/api.md)."""

    batches_per_epoch: Annotated[int | None, Arg(None, _POSITIVE)]
    max_instances_in_memory: Annotated[int | None, Arg(None, _POSITIVE)]
    start_method: Annotated[str, Arg("fork", _one_of(START_METHODS))]
    worker_type: Annotated[str, Arg("process", _one_of(WORKER_TYPES))]
    ray_options: Annotated[dict[str, Any] | None, Arg(None, _ray_options)]
    worker_nice: Annotated[int | None, Arg(None)]  # validate_worker_nice
    cuda_device: Annotated[DeviceLike | None, Arg(None, _device)]
    quiet: Annotated[bool | None, Arg(None, _or_none(_is("True, False or None", bool)))]
    seed: Annotated[int | None, Arg(None, _or_none(_ints("an int or None", least=None)))]
    prefetch: Annotated[int | None, Arg(None, _POSITIVE)]
    fetch_on_loop: Annotated[bool, Arg(False, _FLAG)]
    even_batches: Annotated[bool, Arg(True, _FLAG)]
    zero_copy: Annotated[bool, Arg(True, _FLAG)]
    max_worker_restarts: Annotated[int, Arg(0, _ints(
        "an int >= 0 (0: a dead worker ends the epoch)", least=0))]
    max_batches_per_worker: Annotated[int | None, Arg(None, _or_none(_ints(
        "None or an int >= 1")))]
    max_worker_rss: Annotated[int | None, Arg(None, _or_none(_ints(
        "None or an int >= 1 (bytes)")))]
    log_every: Annotated[float | None, Arg(None, _or_none(partial(
        _seconds, what="a positive number of seconds or None")))]
    load_fn: Annotated[Callable[[Any], Any] | None, Arg(None, _function("key -> instance"))]
    concurrency: Annotated[int | None, Arg(None, _or_none(_ints(
        "an int >= 1 (loads in flight per worker) or None")))]
    ordered: Annotated[bool, Arg(True, _FLAG)]
    retries: Annotated[int | Retry, Arg(0, _retries)]
    on_error: Annotated[str, Arg("raise", _one_of(("raise", "skip"), '"raise" or "skip"'))]


class ReaderOptions(LoaderOptions, total=False):
    """A reader's keywords: torch's arguments by name, and aioloader's own."""

    batch_size: Annotated[int | None, Arg(1, _POSITIVE)]
    shuffle: Annotated[bool | None, Arg(None, _shuffle)]
    sampler: Annotated[Any, Arg(None, _or_none(_is(
        "an iterable of indices (a torch Sampler) or None", _iterable)))]
    batch_sampler: Annotated[Any, Arg(None, _or_none(_is(
        "an aioloader.BatchSampler, an iterable of index lists (a torch BatchSampler) or None",
        lambda value: isinstance(value, BatchSampler) or _iterable(value))))]
    num_workers: Annotated[int, Arg(0, _num_workers)]
    collate_fn: Annotated[Callable[[list[Any]], Any] | None, Arg(None, _function(
        "a list of samples -> a batch"))]
    pin_memory: Annotated[bool, Arg(False, _FLAG)]
    drop_last: Annotated[bool, Arg(False, _FLAG)]
    timeout: Annotated[float | None, Arg(0, _timeout)]
    worker_init_fn: Annotated[Callable[[int], object] | None, Arg(None, _function(
        "worker id -> None"))]
    multiprocessing_context: Annotated[Any, Arg(None)]  # _start_method
    generator: Annotated[torch.Generator | None, Arg(None, _or_none(_is(
        "a torch.Generator or None", torch.Generator)))]
    # torch's keyword-only ones; persistent_workers: torch's False for a dataset, a reader's
    # workers stay (True)
    prefetch_factor: Annotated[int | None, Arg(None, _or_none(_ints("an int >= 1 or None")))]
    persistent_workers: Annotated[bool, Arg(None, _FLAG)]
    pin_memory_device: Annotated[str, Arg("", _is("a str", str))]
    in_order: Annotated[bool, Arg(True, _FLAG)]


# Every row, in the signature's order (torch's arguments first), which is the order checked.
ARGUMENTS: dict[str, Arg] = {
    name: hint.__metadata__[0]
    for name, hint in sorted(get_type_hints(ReaderOptions, include_extras=True).items(),
                             key=lambda row: row[0] in LoaderOptions.__optional_keys__)}


# ---------------------------------------------------------------- between arguments


def _batching(a: dict[str, Any]) -> None:
    """The rules torch's DataLoader and AllenNLP's MultiProcessDataLoader share."""
    batch_size, max_in_memory = a["batch_size"], a["max_instances_in_memory"]
    if a["batch_sampler"] is not None:
        if batch_size != 1 or a["drop_last"] or a["shuffle"] or a["sampler"] is not None:
            given = [f"{name}={a[name]!r}" for name, unset in (
                ("batch_size", 1), ("drop_last", False), ("shuffle", False), ("sampler", None))
                if a[name] != unset]
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                f"sampler, and drop_last (as in torch): got {', '.join(given)}. The batch "
                "sampler decides how instances are batched; leave those at their defaults")
    elif batch_size is None and a["drop_last"]:
        raise ValueError("batch_size=None option disables auto-batching and is mutually "
                         "exclusive with drop_last (as in torch): there is no last batch to "
                         "drop; give a batch_size, or drop_last=False")
    if max_in_memory is not None and batch_size is not None and max_in_memory < batch_size:
        raise ValueError(f"max_instances_in_memory ({max_in_memory}) must be at least "
                         f"batch_size ({batch_size})")


def _torch_samplers(kind: Kind, sampler: Any, shuffle: bool, batch_sampler: Any) -> None:
    """torch's rules for ``sampler``, and what a reader can use."""
    if sampler is not None:
        if shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle (as in torch): "
                             "the sampler decides the order; use RandomSampler to shuffle")
        if kind is not Kind.MAP:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified sampler option, but got "
                f"sampler={type(sampler).__name__}: a sampler yields indices, which only a "
                "map-style Dataset can use (torch's DataLoader refuses it too); a reader or "
                "an IterableDataset orders its own instances")
    if kind is not Kind.MAP and batch_sampler is not None and not isinstance(
            batch_sampler, BatchSampler):
        raise ValueError(
            "DataLoader with IterableDataset: expected unspecified batch_sampler option, but "
            f"got batch_sampler={type(batch_sampler).__name__}: it yields indices, which only "
            "a map-style Dataset can use; to batch a reader or a stream by length, pass an "
            "aioloader.BatchSampler (such as aioloader.BucketBatchSampler)")


def _start_method(start_method: str, context: Any, num_workers: int) -> str:
    """torch's ``multiprocessing_context`` (a start method's name, or a context from
    ``multiprocessing.get_context``) as our ``start_method``."""
    if context is None:
        return start_method
    if isinstance(context, str):
        method = context
    elif callable(getattr(context, "get_start_method", None)):
        method = context.get_start_method()
    else:
        raise ArgumentTypeError("multiprocessing_context option should be a valid context "
                                "object or a string specifying the start method (a start "
                                "method's name, or a context from "
                                "multiprocessing.get_context(...)), but got "
                                f"{_got(context)}")
    if method not in START_METHODS:
        raise ValueError(f"multiprocessing_context option should specify a valid start method "
                         f"in {list(START_METHODS)!r}, but got {context!r}")
    if num_workers == 0:
        raise ValueError("multiprocessing_context can only be used with multi-process loading "
                         f"(num_workers > 0), but got num_workers={num_workers}: without "
                         "workers no process starts")
    if start_method != "fork" and start_method != method:
        raise ValueError(f"start_method={start_method!r} conflicts with "
                         f"multiprocessing_context={context!r}: give one of them")
    return str(method)


def _prefetch_of(prefetch: int | None, prefetch_factor: int | None, num_workers: int) -> int:
    """Slots per worker: ``prefetch``, or torch's ``prefetch_factor`` (batches loaded in
    advance per worker, which is what a slot holds)."""
    if prefetch_factor is None:
        return DEFAULT_PREFETCH if prefetch is None else prefetch
    if num_workers == 0:
        raise ValueError("prefetch_factor can only be given with num_workers > 0 (as with "
                         "torch's DataLoader): without workers nothing is loaded ahead")
    if prefetch is not None and prefetch != prefetch_factor:
        raise ValueError(f"prefetch={prefetch} and prefetch_factor={prefetch_factor} are the "
                         "same option (batches in flight per worker): give one of them")
    return prefetch_factor


def _process_only(a: dict[str, Any]) -> None:
    if a["worker_type"] == "thread":
        given = [f"{name}={a[name]!r}" for name in (
            "max_worker_restarts", "max_batches_per_worker", "max_worker_rss") if a[name]]
        if given:
            raise ValueError(
                f"{', '.join(given)} cannot be used with worker_type='thread': threads share "
                "this process's memory (no resident size of their own to watch) and cannot "
                "be killed, so they are never restarted or recycled. Use "
                "worker_type='process' for that")


def _ray_rules(worker_type: str, ray_options: dict[str, Any] | None) -> None:
    if worker_type != "ray":
        if ray_options is not None:
            raise ValueError(f"ray_options applies to worker_type='ray' only (got "
                             f"worker_type={worker_type!r}): pass worker_type='ray' to run "
                             "the workers as Ray actors, or leave ray_options unset")
        return
    if importlib.util.find_spec("ray") is None:
        raise ImportError(RAY_MISSING)
