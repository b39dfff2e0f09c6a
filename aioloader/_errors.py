"""The exceptions aioloader raises: one type per failure a user must tell apart."""

from __future__ import annotations

import builtins
import pickle
import reprlib
import signal
import threading
import types
from typing import Any, TypeVar

E = TypeVar("E", bound=Exception)


class WorkerError(Exception):
    """A worker process failed: it raised, or it died.

    The message holds the original exception's repr and the worker's traceback; when the
    original exception could be rebuilt in this process it is also the ``__cause__``.

    A worker's exception is raised as an instance of both ``WorkerError`` and the original
    exception's type where Python allows it (as torch re-raises the original type), so
    ``except KeyError:`` around the loop still catches a ``KeyError`` raised in a worker.
    """

    def __init__(self, message: str, *, worker_id: int | None = None,
                 pid: int | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid

    def __str__(self) -> str:
        # Ahead of the original type's own __str__ in a FromWorker class (KeyError's would
        # show the whole message as a quoted repr, OSError's would look for an errno).
        return BaseException.__str__(self)

    def __reduce__(self) -> tuple[object, ...]:
        original = getattr(type(self), "_original_type", None)
        if original is not None:  # a class made on the fly: rebuilt from its original type
            return (_rebuild_from_worker, (original, self.args[0], self.__dict__))
        return (_rebuild, (type(self), self.args[0], self.__dict__))


# Types a worker's exception must never also be: they steer iteration itself (a
# StopAsyncIteration would end the epoch quietly, as if the data were done).
_NEVER_MIXED = (StopIteration, StopAsyncIteration)
_MIXED: dict[type[BaseException], type[WorkerError] | None] = {}
_MIXED_LOCK = threading.Lock()


def worker_error_for(original: BaseException | None, message: str, *, worker_id: int | None,
                     pid: int | None) -> WorkerError:
    """A :class:`WorkerError` that is also of ``type(original)`` where Python allows it
    (``KeyErrorFromWorker(WorkerError, KeyError)``, one class per type), else a plain one;
    its args ``(message,)`` as torch's re-raise, the original's attributes copied. A
    ``SystemExit`` (any BaseException but an Exception) ends a torch worker, which its
    parent reports as a ``RuntimeError`` ("exited unexpectedly"): so is this one."""
    kind = type(original) if isinstance(original, Exception) else RuntimeError
    cls = _mixed_type(kind) if original is not None else None
    if cls is None:  # (one that _mixed_type made can be rebuilt: it tried)
        return WorkerError(message, worker_id=worker_id, pid=pid)
    err = _rebuild(cls, message, {**getattr(original, "__dict__", {}), "worker_id": worker_id,
                                  "pid": pid})
    if isinstance(original, OSError):
        assert isinstance(err, OSError)
        err.errno, err.strerror = original.errno, original.strerror
        err.filename, err.filename2 = original.filename, original.filename2
    return err


def _mixed_type(original: type[BaseException]) -> type[WorkerError] | None:
    """``{Name}FromWorker(WorkerError, original)``, cached; None where it cannot be made
    (not an Exception, an iteration signal, a layout or MRO conflict)."""
    with _MIXED_LOCK:
        if original in _MIXED:
            return _MIXED[original]
        cls: type[WorkerError] | None = None
        if (issubclass(original, Exception) and not issubclass(original, _NEVER_MIXED)
                and not issubclass(original, WorkerError)):
            try:
                cls = types.new_class(f"{original.__name__}FromWorker",
                                      (WorkerError, original),
                                      exec_body=lambda ns: ns.update(
                                          __module__=WorkerError.__module__,
                                          _original_type=original))
                probe = cls.__new__(cls)  # MemoryError-like allocators refuse a subclass
                BaseException.__init__(probe, "")
            except Exception:  # noqa: BLE001 - fall back to a plain WorkerError
                cls = None
        _MIXED[original] = cls
        return cls


def from_worker_class(name: str) -> type[WorkerError] | None:
    """The class named ``name`` (``ValueErrorFromWorker``) that a traceback shows as
    ``aioloader.ValueErrorFromWorker``: one made already, or one for a built-in type; None
    for any other name."""
    if not name.endswith("FromWorker"):
        return None
    with _MIXED_LOCK:
        made = [cls for cls in _MIXED.values() if cls is not None and cls.__name__ == name]
    if made:
        return made[0]
    base = getattr(builtins, name.removesuffix("FromWorker"), None)
    if isinstance(base, type) and issubclass(base, BaseException):
        return _mixed_type(base)
    return None


def _rebuild_from_worker(original: type[BaseException], message: str,
                         state: dict[str, object]) -> Exception:
    cls = _mixed_type(original) or WorkerError
    return _rebuild(cls, message, state)


def _rebuild(cls: type[E], message: str, state: dict[str, object]) -> E:
    """An instance of ``cls`` with ``message`` and the attributes ``state``, its
    ``__init__`` not run (its arguments are not kept)."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class WorkerDied(WorkerError, RuntimeError):
    """A worker process ended without a word: killed by a signal, ``os._exit``, out of memory;
    or it hung (``hung``: silent for that many seconds while a batch was owed, so the loader
    killed it to replace it, ``max_worker_restarts``).

    Also a ``RuntimeError``: torch raises one for a dead worker, and code written for torch
    catches that.

    With ``max_worker_restarts`` spent, ``deaths`` lists every death of the loader's workers
    (this one last) and the message names the earlier ones.
    """

    @property
    def deaths(self) -> list[WorkerDied]:
        return [*self.earlier, self]

    def __init__(self, worker_id: int | str, pid: int | None = None,
                 exitcode: int | None = None, context: str = "", *,
                 earlier: list[WorkerDied] | None = None, hung: float | None = None) -> None:
        self.exitcode = exitcode
        self.earlier = earlier if earlier is not None else []  # deaths that were healed
        self.hung = hung
        if isinstance(worker_id, str):
            # WorkerDied(message): rebuilt from its message alone, as torch's ExceptionWrapper
            # and `type(err)(str(err))` rebuild a RuntimeError (test_dataloader.py's
            # test_segfault did, and got a TypeError)
            super().__init__(worker_id)
            return
        what = (f"hung (no word for {hung:.1f} s while a batch was owed) and was killed"
                if hung is not None else f"died unexpectedly: {describe_exit(exitcode)}")
        super().__init__(f"worker {worker_id} (pid {pid}) {what}"
                         + (f"; {context}" if context else ""),
                         worker_id=worker_id, pid=pid)

    @property
    def kind(self) -> str:
        """The fault: "hang" (silent, killed by the loader) or "crash" (it ended)."""
        return "crash" if self.hung is None else "hang"


# The exit code of a process that spawn (or forkserver) was preparing as a worker, which
# re-ran the parent's unguarded script and so tried to start workers itself: distinct from
# Python's 1 and from 128 + a signal, so that the parent can say what happened (issue 36).
UNGUARDED_MAIN_EXIT = 87
UNGUARDED_MAIN = (
    "it re-ran your script's top-level code (start_method 'spawn' and 'forkserver' import the "
    "main module in each new process), and that code started workers of its own before this "
    "one could begin. "
    "Put the code that makes and iterates the loader under `if __name__ == \"__main__\":` (as "
    "the multiprocessing docs ask, \"Safe importing of main module\"), or use "
    "start_method=\"fork\"")


_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGKILL: " — often the out-of-memory killer; check `dmesg` and memory limits",
    signal.SIGSEGV: " — a crash in native code (segmentation fault)",
    signal.SIGBUS: " — a bus error, often shared memory that ran out",
}


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3', 'killed by signal 9 (SIGKILL)' or 'exit status unknown'."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode == UNGUARDED_MAIN_EXIT:
        return f"exit code {exitcode}: {UNGUARDED_MAIN}"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {-exitcode} ({name}){_SIGNAL_HINTS.get(-exitcode, '')}"


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError``, as torch raises for one. Also a
    ``ValueError``, which is what the loader raised for several of these before issue 19, so
    that an ``except ValueError`` written then still catches them."""


class CollateKeyError(KeyError):
    """A sample of a batch lacks a key that the batch's first sample has (the default collate
    and ``PadCollate`` take each key from the first sample, as torch's does).

    A ``KeyError``, as torch's ``default_collate`` raises here, so code that catches that
    still does. ``key``: the key; ``position``: the sample's place in the batch; ``sample``:
    its dataset index (or key) where the loader knows it, else None; ``where``: the key's
    place inside a sample ("at the top level", "at ['meta']"); ``first_keys`` and
    ``sample_keys``: the keys of the first sample and of this one.
    """

    def __init__(self, key: object, position: int, first_keys: list[object],
                 sample_keys: list[object], where: str, sample: object = None) -> None:
        self.key = key
        self.position = position
        self.first_keys = first_keys
        self.sample_keys = sample_keys
        self.where = where
        self.sample = sample
        which = f"sample {position} of the batch"
        if sample is not None:
            which += f" (index {sample!r})"
        super().__init__(
            f"{which} has no key {key!r} {where}, which the first sample has: the first "
            f"sample's keys are {reprlib.repr(first_keys)}, this one's "
            f"{reprlib.repr(sample_keys)}. Give "
            "every sample the same keys, or pass a collate_fn that fills the missing ones")

    def with_sample(self, sample: object) -> CollateKeyError:
        """The same error, naming the sample's dataset index (or key)."""
        return CollateKeyError(self.key, self.position, self.first_keys, self.sample_keys,
                               self.where, sample)

    def __str__(self) -> str:
        return str(self.args[0])  # not KeyError's repr of it, in quotes

    def __reduce__(self) -> tuple[object, ...]:
        return (CollateKeyError, (self.key, self.position, self.first_keys,
                                  self.sample_keys, self.where, self.sample))


class LoaderTimeoutError(TimeoutError, RuntimeError):
    """No batch arrived within the loader's ``timeout``; names the workers that are behind.

    Also a ``RuntimeError``, which torch raises for a timeout and its users catch."""


class SourcePicklingError(pickle.PicklingError, TypeError):
    """The reader, dataset, sampler or collate cannot be sent to a spawned worker."""


class BatchFailure(Exception):
    """Internal: making batch ``seq`` raised ``error`` in its worker, which went on; the epoch
    raises ``error`` in the batch's turn and goes on, as torch's iterator does (issue 32).
    A stream's says where it lies in its pass (``mark``) and the slot it held (``slot``)."""

    def __init__(self, seq: int, error: BaseException, mark: Any = None,
                 slot: int | None = None) -> None:
        super().__init__(seq, error)
        self.seq = seq
        self.error = error
        self.mark = mark
        self.slot = slot


class FixedOptionError(AttributeError, ValueError):
    """An option assigned after the loader was built. An ``AttributeError`` (a read-only
    attribute) that is also the ``ValueError`` torch's ``DataLoader`` raises for it."""


class LoaderBusyError(RuntimeError):
    """The loader is already being iterated: one epoch at a time per loader."""


class LoaderClosedError(RuntimeError):
    """The loader was closed (``close()``/``aclose()`` from another task or thread, or the
    garbage collector) while this iteration waited for a batch."""


class FrameTooLargeError(ValueError):
    """A message between a worker and the main process exceeds the wire's frame limit."""


class ResumeError(ValueError):
    """A state dict cannot be loaded: it is not a loader's state, or it was taken with other
    arguments (or other data) than this loader's; the message names what differs."""


class ResumeWarning(UserWarning):
    """Resuming costs more than it could: a source without a state of its own is read again
    up to the position and the instances before it are dropped."""


class LoadError(Exception):
    """Loading one key failed, after its retries (the load stage, issue 11).

    ``key``: the key; ``worker_id``: the worker that loaded it (None: the main process);
    ``attempts``: how many times it was tried. The original error is the ``__cause__``.
    """

    def __init__(self, key: object, worker_id: int | None, attempts: int,
                 cause: BaseException | None = None, *, note: str = "") -> None:
        where = "the main process" if worker_id is None else f"worker {worker_id}"
        super().__init__(
            f"loading key {key!r} failed in {where} after {attempts} attempt(s): {cause!r}"
            + (f"; {note}" if note else ""))
        self.key = key
        self.worker_id = worker_id
        self.attempts = attempts

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], self.__dict__))
