"""The checks of the DataLoader's arguments: each one's type and range, then the rules between
them, before anything is read or started (issue 19). ``_config.build_config`` runs them."""

from __future__ import annotations

import importlib.util
import numbers
import operator
import os
import reprlib
import warnings
from typing import Any

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
    """Each argument of ``DataLoader(...)`` alone: ``TypeError`` for a wrong type
    (:class:`ArgumentTypeError`), ``ValueError`` for a wrong value; each message names the
    argument, what it got and what it takes. Returns them as the loader keeps them: ints as
    ``int`` (a numpy integer too), torch's ``timeout=0`` and ``shuffle=None`` as ours."""
    _dataset_data_path(data_path, kind)
    a = dict(arguments)
    a["batch_size"] = _optional_int("batch_size", a["batch_size"], "a positive int or None",
                                    least=1)
    _flag("drop_last", a["drop_last"])
    a["shuffle"] = _shuffle(a["shuffle"])
    _batch_sampler(a["batch_sampler"])
    a["batches_per_epoch"] = _optional_int("batches_per_epoch", a["batches_per_epoch"],
                                           "a positive int or None", least=1)
    if _int_like(a["num_workers"]) and operator.index(a["num_workers"]) < 0:
        raise ValueError(f"num_workers option should be non-negative (as torch says); use "
                         f"num_workers=0 to disable multiprocessing, got {a['num_workers']}")
    a["num_workers"] = _int("num_workers", a["num_workers"],
                            "an int >= 0 (0: no worker processes)", least=0)
    a["max_instances_in_memory"] = _optional_int(
        "max_instances_in_memory", a["max_instances_in_memory"], "a positive int or None",
        least=1)
    _choice("start_method", a["start_method"], START_METHODS)
    _choice("worker_type", a["worker_type"], WORKER_TYPES)
    a["ray_options"] = _ray_options(a.get("ray_options"))  # optional: a newer argument
    a["device"] = _device(a.pop("cuda_device"))
    if a["quiet"] is not None:
        _flag("quiet", a["quiet"], "True, False or None")
    _callable("collate_fn", a["collate_fn"], "a list of samples -> a batch")
    a["seed"] = _optional_int("seed", a["seed"], "an int or None", least=None)
    a["timeout"] = _timeout(a["timeout"])
    a["prefetch"] = _optional_int("prefetch", a["prefetch"], "a positive int or None", least=1)
    _flag("fetch_on_loop", a.setdefault("fetch_on_loop", False))  # optional: a newer argument
    _flag("even_batches", a["even_batches"])
    _flag("zero_copy", a["zero_copy"])
    a["max_worker_restarts"] = _int("max_worker_restarts", a["max_worker_restarts"],
                                    "an int >= 0 (0: a dead worker ends the epoch)", least=0)
    a["max_batches_per_worker"] = _optional_int(
        "max_batches_per_worker", a["max_batches_per_worker"], "None or an int >= 1", least=1)
    a["max_worker_rss"] = _optional_int("max_worker_rss", a["max_worker_rss"],
                                        "None or an int >= 1 (bytes)", least=1)
    if a["log_every"] is not None:
        _seconds("log_every", a["log_every"], "a positive number of seconds or None")
    _callable("load_fn", a["load_fn"], "key -> instance")
    a["concurrency"] = _optional_int(
        "concurrency", a["concurrency"], "an int >= 1 (loads in flight per worker) or None",
        least=1)
    _flag("ordered", a["ordered"])
    if not isinstance(a["retries"], Retry):
        a["retries"] = _int("retries", a["retries"], "an int >= 0 or an aioloader.Retry",
                            least=0)
    _choice("on_error", a["on_error"], ("raise", "skip"), '"raise" or "skip"')
    _sampler(a["sampler"])
    _callable("worker_init_fn", a["worker_init_fn"], "worker id -> None")
    _flag("persistent_workers", a["persistent_workers"])
    a["prefetch_factor"] = _optional_int("prefetch_factor", a["prefetch_factor"],
                                         "an int >= 1 or None", least=1)
    generator = a["generator"]
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ArgumentTypeError(f"generator must be a torch.Generator or None, got "
                                f"{_got(generator)}")
    _flag("in_order", a["in_order"])
    _flag("pin_memory", a["pin_memory"])
    if not isinstance(a["pin_memory_device"], str):
        raise ArgumentTypeError(f"pin_memory_device must be a str, got "
                                f"{_got(a['pin_memory_device'])}")
    return a


def check_rules(kind: Kind, data_path: Any, a: dict[str, Any]) -> None:
    """The rules between arguments (``a``: as :func:`check_each` returned them); torch's
    ``multiprocessing_context`` and ``prefetch_factor`` become ``start_method`` and
    ``prefetch`` in ``a``."""
    a["start_method"] = _start_method(a["start_method"], a["multiprocessing_context"],
                                      a["num_workers"])
    a["prefetch"] = _prefetch_of(a["prefetch"], a["prefetch_factor"], a["num_workers"])
    _torch_samplers(kind, sampler=a["sampler"], shuffle=a["shuffle"],
                    batch_sampler=a["batch_sampler"])
    _batching(batch_size=a["batch_size"], drop_last=a["drop_last"], shuffle=a["shuffle"],
              sampler=a["sampler"], batch_sampler=a["batch_sampler"],
              max_instances_in_memory=a["max_instances_in_memory"])
    _ray_rules(a["worker_type"], a["ray_options"])
    if a["fetch_on_loop"] and a["num_workers"] > 0:
        raise ValueError(
            f"fetch_on_loop=True runs num_workers=0 fetches on the caller's loop; with "
            f"num_workers={a['num_workers']} the workers fetch. Drop fetch_on_loop, or use "
            "num_workers=0")
    _process_only(a["worker_type"], max_worker_restarts=a["max_worker_restarts"],
                  max_batches_per_worker=a["max_batches_per_worker"],
                  max_worker_rss=a["max_worker_rss"])
    _worker_number(a["num_workers"], a["worker_type"])
    a["worker_nice"] = validate_worker_nice(a["worker_nice"], num_workers=a["num_workers"],
                                            worker_type=a["worker_type"])


def check_load_rules(kind: Kind, loads: LoadOptions | None, a: dict[str, Any]) -> None:
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
    """``worker_nice`` as an int from 0 to 19, for a loader that has worker processes.

    None (the default) is :data:`FULL_NICE` where the worker processes are as many as the
    cores this process may run on, so that they can keep every core busy and the consumer
    would wait for one each time it wakes, and 0 otherwise; an explicit 0 stays 0.
    """
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


def _optional_int(name: str, value: Any, what: str, *, least: int | None) -> int | None:
    return None if value is None else _int(name, value, what, least=least)


def _flag(name: str, value: Any, what: str = "True or False") -> bool:
    # torch refuses a non-bool drop_last too (BatchSampler), numpy's bool_ included.
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
    return value


def _shuffle(value: Any) -> bool:
    """torch's ``shuffle``: None is False, and an int counts by its truth (torch tests
    ``if shuffle:``, so ``shuffle=1`` shuffles and ``shuffle=3`` meets its sampler rules)."""
    if value is None:
        return False
    if _int_like(value):
        return bool(operator.index(value))
    return _flag("shuffle", value, "True, False, None or an int (its truth)")


def _seconds(name: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
    if not float(value) > 0:  # NaN too
        raise ValueError(f"{name} must be {what}, got {_got(value)}")


def _timeout(value: Any) -> float | None:
    """``timeout`` as given (an int or float stays one); torch's ``timeout=0`` is None."""
    if value is None or (not isinstance(value, bool) and isinstance(value, numbers.Real)
                         and value == 0):
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"timeout option should be non-negative (as torch says): a number of "
                         f"seconds, or 0 or None for no timeout; got {value}")
    _seconds("timeout", value, "a positive number of seconds, 0 or None (no timeout)")
    seconds: float = value  # as given: an int stays an int
    return seconds


def _callable(name: str, value: Any, signature: str) -> None:
    if value is not None and not callable(value):
        raise ArgumentTypeError(f"{name} must be callable ({signature}) or None, got "
                                f"{_got(value)}")


def _choice(name: str, value: Any, choices: tuple[str, ...], what: str | None = None) -> None:
    what = what or f"one of {', '.join(map(repr, choices))}"
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be {what}, got {_got(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _iterable(value: Any) -> bool:
    return not isinstance(value, (str, bytes)) and hasattr(value, "__iter__")


def _sampler(sampler: Any) -> None:
    if sampler is not None and not _iterable(sampler):
        raise ArgumentTypeError(f"sampler must be an iterable of indices (a torch Sampler) "
                                f"or None, got {_got(sampler)}")


def _batch_sampler(batch_sampler: Any) -> None:
    if batch_sampler is None or isinstance(batch_sampler, BatchSampler):
        return
    if not _iterable(batch_sampler):
        raise ArgumentTypeError(
            "batch_sampler must be an aioloader.BatchSampler, an iterable of index lists (a "
            f"torch BatchSampler) or None, got {_got(batch_sampler)}")


def _device(cuda_device: Any) -> torch.device | None:
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


def _dataset_data_path(data_path: Any, kind: Kind) -> None:
    """A dataset reads no ``data_path``: one given is a mistake, never silently dropped."""
    if kind is not Kind.READER and data_path is not None:
        raise ValueError(f"data_path={data_path!r} was given for a {kind.value}, which reads "
                         "no data_path (only a reader's read(data_path) does): leave it out")


# ---------------------------------------------------------------- between arguments


def _batching(*, batch_size: int | None, drop_last: bool, shuffle: bool, sampler: Any,
              batch_sampler: Any, max_instances_in_memory: int | None) -> None:
    """The rules torch's DataLoader and AllenNLP's MultiProcessDataLoader share."""
    if batch_sampler is not None:
        if batch_size != 1 or drop_last or shuffle or sampler is not None:
            given = [f"{name}={value!r}" for name, value, unset in (
                ("batch_size", batch_size, 1), ("drop_last", drop_last, False),
                ("shuffle", shuffle, False), ("sampler", sampler, None)) if value != unset]
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                f"sampler, and drop_last (as in torch): got {', '.join(given)}. The batch "
                "sampler decides how instances are batched; leave those at their defaults")
    elif batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually "
                         "exclusive with drop_last (as in torch): there is no last batch to "
                         "drop; give a batch_size, or drop_last=False")
    if (max_instances_in_memory is not None and batch_size is not None
            and max_instances_in_memory < batch_size):
        raise ValueError(f"max_instances_in_memory ({max_instances_in_memory}) must be at "
                         f"least batch_size ({batch_size})")


def _torch_samplers(kind: Kind, *, sampler: Any, shuffle: bool, batch_sampler: Any) -> None:
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


def _process_only(worker_type: str, **options: int | None) -> None:
    if worker_type == "thread":
        given = [f"{name}={value!r}" for name, value in options.items() if value]
        if given:
            raise ValueError(
                f"{', '.join(given)} cannot be used with worker_type='thread': threads share "
                "this process's memory (no resident size of their own to watch) and cannot "
                "be killed, so they are never restarted or recycled. Use "
                "worker_type='process' for that")


def _ray_options(options: Any) -> dict[str, Any] | None:
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


def _ray_rules(worker_type: str, ray_options: dict[str, Any] | None) -> None:
    if worker_type != "ray":
        if ray_options is not None:
            raise ValueError(f"ray_options applies to worker_type='ray' only (got "
                             f"worker_type={worker_type!r}): pass worker_type='ray' to run "
                             "the workers as Ray actors, or leave ray_options unset")
        return
    if importlib.util.find_spec("ray") is None:
        raise ImportError(RAY_MISSING)
