"""One epoch of iteration, and the backstops that stop what nobody closed.

An epoch is an async iterator object, deliberately not an async generator: dropping it
half-way (``break``, ``next(iter(loader))``) is seen at once through a weak reference, and
its backstop stops its workers on the loop it ran on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

# Imported with the package, not at an epoch's start: tqdm.auto takes 20-50 ms to import
# (it looks for IPython), which would block the consumer's event loop (issue 13, start lag).
from tqdm.auto import tqdm

from ._device import move_to, pin
from ._distributed import all_reduce
from ._errors import LoaderBusyError
from ._loops import running_loop
from ._session import GRACE, PassDone, Session
from ._sources import Kind
from ._staging import Stager

if TYPE_CHECKING:
    from ._loader import DataLoader

# Every pending backstop of this process. A forked child drops them all (register_at_fork
# below), so that a loader collected there never touches the parent's workers (issue 9).
_BACKSTOPS: set[weakref.finalize[Any, Any]] = set()


def backstop(obj: object, fn: Callable[..., None], *args: Any) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(obj, fn, *args)``, dropped in forked children."""
    holder: list[weakref.finalize[Any, Any]] = []

    def run() -> None:
        _BACKSTOPS.discard(holder[0])
        fn(*args)

    finalizer = weakref.finalize(obj, run)
    holder.append(finalizer)
    _BACKSTOPS.add(finalizer)
    return finalizer


def drop_backstop(finalizer: weakref.finalize[Any, Any]) -> None:
    finalizer.detach()
    _BACKSTOPS.discard(finalizer)


def _forget_backstops_in_child() -> None:
    for finalizer in list(_BACKSTOPS):
        finalizer.detach()
    _BACKSTOPS.clear()


os.register_at_fork(after_in_child=_forget_backstops_in_child)


class Epoch:
    """One epoch of iteration: an async iterator, deliberately not an async generator.

    Dropping it half-way (``break``, ``next(iter(loader))``) is seen at once through a weak
    reference, so the next epoch never waits for the loop to finalize a generator; its
    workers are stopped by the next epoch, a close, or the loader's backstop.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None, *,
                 private: bool) -> None:
        self._loader = loader
        self._device = device
        self._private = private  # driven by the sync adapter's own loop
        self._session: Session | None = None
        self._produced = 0
        self._done = False
        self._bar: Any = None
        self._backstop: weakref.finalize[Any, Any] | None = None
        self._stager: Stager | None = None  # made on the first batch bound for CUDA

    def __aiter__(self) -> Epoch:
        return self

    async def _begin(self) -> Session:
        loader = self._loader
        # An earlier epoch that handed over all its batches is over, even if nobody asked it
        # for its end: Lightning, zip() and islice() take len(loader) batches and move on.
        full = _delivered_all(loader)
        with loader._lock:
            current = loader._epoch() if loader._epoch is not None else None
            if current is not None and current is not self and not full:
                raise LoaderBusyError(
                    "this loader is already being iterated: finish or close that epoch "
                    "first (`await loader.aclose()`), or make a second DataLoader")
            dropped = loader._epoch is not None  # an earlier epoch was left unfinished
            loader._epoch = weakref.ref(self)
            owed, loader._owed_end = loader._owed_end or (dropped and full), False
        if current is not None and current is not self:
            current._abandon()
        before = loader._box.session
        if dropped and before is not None and not full:
            await loader._drop_session(before)  # the next epoch starts that one again
        live = before is not None and not before.closed and loader._box.session is before
        if owed and loader.batches_per_epoch is None and not live:
            self._pass_done()  # its pass end went with its session
        session = await loader._session()
        session.attach(private=self._private)
        if owed and loader.batches_per_epoch is None and session is before:
            session = await self._finish_pass(session)
        self._session = session
        self._produced = loader._cursor.begin_epoch()
        self._backstop = backstop(self, _close_dropped, weakref.ref(loader), session)
        self._bar = _bar(loader)
        return session

    async def _finish_pass(self, session: Session) -> Session:
        """Take the pass end that an earlier, fully consumed epoch left unasked for."""
        loader = self._loader
        step = await session.next(loader.timeout)
        if isinstance(step, PassDone):
            self._pass_done()
            return session
        # The epoch was longer than len() said (a sampler whose len() is off): start the
        # pass again rather than lose the batch just taken.
        session.detach()
        await loader._drop_session(session)
        session = await loader._session()
        session.attach(private=self._private)
        return session

    def _abandon(self) -> None:
        """Left behind by a new epoch after it handed over all its batches."""
        self._done = True
        self._loader._meter.epoch_ended(time.monotonic())
        if self._backstop is not None:
            drop_backstop(self._backstop)
        if self._bar is not None:
            self._bar.close()

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        loader = self._loader
        began = time.monotonic()
        try:
            session = self._session
            if session is None:
                session = await self._begin()
                loader._meter.epoch_began(began)
            while True:
                if loader.batches_per_epoch is not None and (
                        self._produced >= loader.batches_per_epoch):
                    break
                step = await session.next(loader.timeout)
                if _agree_each_batch(loader) and not await _all_have(loader, step):
                    while not isinstance(step, PassDone):  # the others are done: skip ours
                        step = await session.next(loader.timeout)
                    self._pass_done()
                    break
                if isinstance(step, PassDone):
                    self._pass_done()
                    if loader.batches_per_epoch is None or step.empty:
                        break
                    continue
                self._produced += 1
                loader._cursor.delivered()
                self._handed(began, step.nbytes)
                if not self._private:
                    # Batches that were already waiting would otherwise come back to back
                    # without the loop running anything else in between.
                    await asyncio.sleep(0)
                return self._to_target(step.value)
        except BaseException as exc:
            # After an error nobody waits for the workers' last words: no grace.
            await self._finish(stop=True, grace=0.0 if isinstance(exc, Exception) else GRACE)
            raise
        await self._finish(stop=False)
        raise StopAsyncIteration

    def _to_target(self, value: Any) -> Any:
        """The batch where the consumer wants it: through the pinned ring to CUDA,
        pinned (``pin_memory=True``) on the CPU, or moved with ``.to()`` elsewhere."""
        device = self._device
        if device is not None and device.type == "cuda":
            if self._stager is None:
                self._stager = Stager(device)
            return self._stager.stage(value)
        if self._loader._pin:
            value = pin(value)
        return value if device is None else move_to(value, device)

    def _handed(self, began: float, nbytes: int) -> None:
        """Telemetry for a batch about to be handed over: the meter, the bar, the log."""
        loader = self._loader
        now = time.monotonic()
        meter = loader._meter
        meter.handed(began, now, nbytes)
        bar = self._bar
        bar.update(1)
        if not bar.disable and bar.n % 8 == 0:
            _show_stall(bar, loader)
        if loader.log_every is not None and now >= loader._next_log:
            loader._next_log = now + loader.log_every
            _LOG.info("aioloader: %s", loader.stats())

    def _pass_done(self) -> None:
        loader = self._loader
        loader._next_pass += 1
        loader._session_pass += 1
        loader._cursor.pass_done()

    async def aclose(self) -> None:
        """Stop a half-consumed epoch and its workers (the loader can be iterated again).

        An epoch that handed over all its batches is simply over: its workers stay.
        """
        if self._done:
            return
        if self._session is not None and not self._session.closed and _delivered_all(
                self._loader):
            self._loader._owed_end = True  # the next epoch takes this one's pass end
            await self._finish(stop=False)
        else:
            await self._finish(stop=self._session is not None)

    async def _finish(self, *, stop: bool, grace: float = GRACE) -> None:
        self._done = True
        if self._backstop is not None:
            drop_backstop(self._backstop)
        loader, session = self._loader, self._session
        if self._bar is not None:
            if not self._bar.disable:
                _show_stall(self._bar, loader)
            self._bar.close()
        loader._meter.epoch_ended(time.monotonic())
        with loader._lock:
            if loader._epoch is not None and loader._epoch() is self:
                loader._epoch = None
        if session is None:
            return
        if not stop:
            loader._cursor.in_epoch = 0  # between epochs
            if not loader._keeps_workers():  # persistent_workers=False: none between epochs
                loader._hold_position()
                stop = True
        if stop:
            await loader._drop_session(session, grace)
        elif not session.closed:
            session.detach()


_LOG = logging.getLogger("aioloader.stats")
_CLOSING: set[asyncio.Task[None]] = set()  # closes of dropped epochs, until they are done


def _close_dropped(loader_ref: weakref.ref[DataLoader], session: Session) -> None:
    """An epoch was dropped half-way: stop its workers on its loop, if that loop runs, or
    here and now if that loop is closed.

    Otherwise (the sync adapter's loop between two calls) the next epoch, a close or the
    loader's backstop does it.
    """
    loop = session.loop
    if os.getpid() != session.owner_pid or loop is None:
        return
    if loop.is_closed():  # dropped after its loop ended (held by a traceback, say)
        _close_now(session)
        return
    if not loop.is_running():
        return

    def spawn() -> None:
        loader = loader_ref()
        if loader is not None and loader._epoch is not None and loader._epoch() is not None:
            return  # a newer epoch runs: the session is its business now
        closing = loader._drop_session(session) if loader is not None else session.aclose()
        task = loop.create_task(closing)
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)
        # asyncio.run cancels the tasks left when its main coroutine ends: this one before
        # its first step where the epoch was dropped there (a `break` or an exception in
        # its `async for`), and its workers would outlive the loop (issue 19).
        task.add_done_callback(lambda t: _close_now(session) if t.cancelled() else None)

    if running_loop() is loop:
        spawn()  # on the loop, now: not a step later, when the loop may be stopping
    else:
        loop.call_soon_threadsafe(spawn)


def _close_now(session: Session) -> None:
    """Close ``session`` in this thread, without grace, unless a close already began (its
    reaping runs in a thread of its own and ends by itself). Its loader is left alone (we
    may be in the garbage collector, inside its lock): it drops a closed session itself."""
    if not session.closed:
        session.close(0.0)


def _show_stall(bar: Any, loader: DataLoader) -> None:
    meter = loader._meter
    bar.set_postfix_str(f"data stall {meter.wait / max(meter.wall(), 1e-9):.0%}",
                        refresh=False)


class _NoBar:
    """What a quiet loader's bars are: not a disabled tqdm, whose construction starts
    tqdm's monitor thread in the user's process and costs the loop ~0.1 ms an epoch."""

    disable = True
    n = 0

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_NO_BAR = _NoBar()


def shows_bars(quiet: bool | None) -> bool:
    """Whether a bar is drawn now: ``quiet=None`` follows tqdm's convention (a terminal or a
    notebook, not a log file or CI), asked as each bar is built so a redirected stderr counts.

    torch's loader prints nothing; a script ported by its import must not fill logs (issue 19).
    """
    if quiet is not None:
        return not quiet
    isatty = getattr(sys.stderr, "isatty", None)  # stderr is None under pythonw, or a stand-in
    try:
        if isatty is not None and isatty():
            return True
    except (OSError, ValueError):  # a closed stderr
        pass
    return _in_notebook()


def _in_notebook() -> bool:
    """A Jupyter kernel, whose stderr is no TTY but shows bars; asked without importing
    IPython (a fraction of a second), which a kernel has imported already."""
    app = getattr(sys.modules.get("ipykernel.kernelapp"), "IPKernelApp", None)
    initialized = getattr(app, "initialized", None)  # traitlets' SingletonConfigurable
    return callable(initialized) and bool(initialized())


def progress_bar(quiet: bool | None, **options: Any) -> Any:
    """``tqdm(**options)`` where bars are shown (:func:`shows_bars`), else a bar that does
    nothing."""
    return tqdm(**options) if shows_bars(quiet) else _NO_BAR


def _bar(loader: DataLoader) -> Any:
    if not shows_bars(loader.quiet):
        return _NO_BAR
    total = loader.batches_per_epoch
    if total is None and (loader._kind is Kind.MAP or loader._cache is not None):
        total = len(loader)  # only for a bar that shows it
    return tqdm(total=total, initial=loader._cursor.in_epoch, desc="batches", unit="batch",
                dynamic_ncols=True)


def _delivered_all(loader: DataLoader) -> bool:
    """The current epoch handed over as many batches as it has (when that is known)."""
    in_epoch = loader._cursor.in_epoch
    if not in_epoch:
        return False
    if loader.batches_per_epoch is not None:
        return in_epoch >= loader.batches_per_epoch
    if loader._kind is Kind.MAP or loader._cache is not None:
        return in_epoch >= len(loader)
    return False


def _agree_each_batch(loader: DataLoader) -> bool:
    """Streams have no length: with even_batches, ranks agree batch by batch."""
    return (loader._topo.distributed and loader.even_batches
            and loader.batches_per_epoch is None and loader._kind is not Kind.MAP
            and loader.max_instances_in_memory is not None)


async def _all_have(loader: DataLoader, step: Any) -> bool:
    have = 0 if isinstance(step, PassDone) else 1
    return bool(await asyncio.to_thread(all_reduce, loader._topo, have, "min"))


