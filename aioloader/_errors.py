"""The exceptions aioloader raises: one type per failure a user must tell apart."""

from __future__ import annotations

import pickle
import threading
import types


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
    """A :class:`WorkerError` that is also an instance of ``type(original)`` when Python
    allows it (``KeyErrorFromWorker(WorkerError, KeyError)``, one class per type), else a
    plain one. Its args are ``(message,)`` as with torch's re-raise; the original's
    attributes are copied (``errno``, ``filename``, a user's own), the original itself is
    the ``__cause__``."""
    cls = _mixed_type(type(original)) if original is not None else None
    if cls is not None:
        try:
            err: WorkerError = cls.__new__(cls)
            BaseException.__init__(err, message)
        except Exception:  # noqa: BLE001 - an exotic __new__: the plain error will do
            cls = None
    if cls is None:
        return WorkerError(message, worker_id=worker_id, pid=pid)
    if isinstance(original, OSError):
        assert isinstance(err, OSError)
        err.errno, err.strerror = original.errno, original.strerror
        err.filename, err.filename2 = original.filename, original.filename2
    err.__dict__.update(getattr(original, "__dict__", {}))
    err.worker_id = worker_id
    err.pid = pid
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


def _rebuild_from_worker(original: type[BaseException], message: str,
                         state: dict[str, object]) -> Exception:
    cls = _mixed_type(original) or WorkerError
    return _rebuild(cls, message, state)


def _rebuild(cls: type[Exception], message: str, state: dict[str, object]) -> Exception:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class WorkerDied(WorkerError):
    """A worker process ended without a word: killed by a signal, ``os._exit``, out of memory;
    or it hung (``hung``: silent for that many seconds while a batch was owed, so the loader
    killed it to replace it, ``max_worker_restarts``).

    With ``max_worker_restarts`` spent, ``deaths`` lists every death of the loader's workers
    (this one last) and the message names the earlier ones.
    """

    @property
    def deaths(self) -> list[WorkerDied]:
        return [*self.earlier, self]

    def __init__(self, worker_id: int, pid: int | None, exitcode: int | None,
                 context: str = "", *, earlier: list[WorkerDied] | None = None,
                 hung: float | None = None) -> None:
        self.exitcode = exitcode
        self.earlier = earlier if earlier is not None else []  # deaths that were healed
        self.hung = hung
        what = (f"hung (no word for {hung:.1f} s while a batch was owed) and was killed"
                if hung is not None else f"died unexpectedly: {describe_exit(exitcode)}")
        super().__init__(f"worker {worker_id} (pid {pid}) {what}"
                         + (f"; {context}" if context else ""),
                         worker_id=worker_id, pid=pid)

    @property
    def kind(self) -> str:
        """The fault: "hang" (silent, killed by the loader) or "crash" (it ended)."""
        return "crash" if self.hung is None else "hang"


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3', 'killed by signal 9 (SIGKILL)' or 'exit status unknown'."""
    import signal

    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        hint = ""
        if -exitcode == signal.SIGKILL:
            hint = " — often the out-of-memory killer; check `dmesg` and memory limits"
        elif -exitcode == signal.SIGSEGV:
            hint = " — a crash in native code (segmentation fault)"
        elif -exitcode == signal.SIGBUS:
            hint = " — a bus error, often shared memory that ran out"
        return f"killed by signal {-exitcode} ({name}){hint}"
    return f"exit code {exitcode}"


class LoaderTimeoutError(TimeoutError):
    """No batch arrived within the loader's ``timeout``; names the workers that are behind."""


class SourcePicklingError(pickle.PicklingError, TypeError):
    """The reader, dataset, sampler or collate cannot be sent to a spawned worker."""


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
