"""One epoch of iteration over a run: telemetry and the hand-over to the target device.

An async iterator object, not an async generator, so that dropping it half-way is seen at
once (docs/architecture.md, "The loader"); its backstop stops its workers on its loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from typing import Any

import torch

from .._errors import BatchFailure, LoaderBusyError
from .._loops import running_loop
from ..plane._device import move_to, pin
from ..plane._staging import Stager
from ._backstop import backstop, drop_backstop
from ._bars import NO_BAR, progress_bar
from ._run import Run
from ._session import GRACE, Session

_LOG = logging.getLogger("aioloader.stats")
_CLOSING: set[asyncio.Task[None]] = set()  # closes of dropped epochs, until they are done


class Epoch:
    """One epoch: batches from ``run``, on ``device``; ``owner`` (the loader) is held only so
    that it, and its run, live as long as the iteration does."""

    def __init__(self, owner: object, run: Run, device: torch.device | None, *,
                 private: bool) -> None:
        self._owner = owner
        self._run = run
        self._device = device
        self._private = private  # driven by the sync adapter's own loop
        self._session: Session | None = None
        self.done = False  # ended: complete, stopped by an error, closed or superseded
        self._superseded = False  # a newer iteration of the loader took over
        self.waiting = False
        self._bar: Any = NO_BAR
        self._backstop: weakref.finalize[Any, Any] | None = None
        self._stager: Stager | None = None  # made on the first batch bound for CUDA

    def __aiter__(self) -> Epoch:
        return self

    async def __anext__(self) -> Any:
        if self._superseded:
            raise LoaderBusyError(
                "this iteration was superseded: the loader was iterated again (iter(loader) "
                "or `async for` started anew, as torch's DataLoader allows), which stopped "
                "this one. Iterate the newer one, or make a second DataLoader to have two "
                "epochs at once")
        if self.done:
            raise StopAsyncIteration
        run = self._run
        began = time.monotonic()
        try:
            session = self._session
            if session is None:
                session = self._session = await run.begin(self, self._private)
                self._backstop = backstop(self, _close_dropped, weakref.ref(run), session)
                self._bar = progress_bar(run.config.output.quiet, total=run.epoch_length,
                                         initial=run.in_epoch_count, desc="batches",
                                         unit="batch", dynamic_ncols=True)
                run.meter.epoch_began(began)
            self.waiting = True
            try:
                step = await run.next(session)
            finally:
                self.waiting = False
            if step is not None and not isinstance(step, BatchFailure):
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
        if step is not None:  # that batch's error: the epoch goes on, as torch's does
            raise step.error
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
        if self._run.config.output.pin:
            value = pin(value)
        return value if device is None else move_to(value, device)

    def _handed(self, began: float, nbytes: int) -> None:
        """Telemetry for a batch about to be handed over: the meter, the bar, the log."""
        run = self._run
        now = time.monotonic()
        run.meter.handed(began, now, nbytes)
        bar = self._bar
        bar.update(1)
        if not bar.disable and bar.n % 8 == 0:
            _show_stall(bar, run)
        every = run.config.output.log_every
        if every is not None and now >= run.next_log:
            run.next_log = now + every
            _LOG.info("aioloader: %s", run.stats())

    def abandon(self, superseded: bool = False) -> None:
        """Left behind by a new epoch: after it handed over all its batches, or before
        (``superseded``: its consumer is told so if it asks for more)."""
        self._superseded = superseded
        self._ended()

    async def aclose(self) -> None:
        """Stop a half-consumed epoch and its workers (the loader can be iterated again); one
        that handed over all its batches is simply over: its workers stay."""
        if self.done:
            return
        self._ended()
        await self._run.leave(self, self._session)

    async def _finish(self, *, stop: bool, grace: float = GRACE) -> None:
        self._ended()
        await self._run.end(self, self._session, stop=stop, grace=grace)

    def _ended(self) -> None:
        self.done = True
        if self._backstop is not None:
            drop_backstop(self._backstop)
        if not self._bar.disable:
            _show_stall(self._bar, self._run)
        self._bar.close()
        self._run.meter.epoch_ended(time.monotonic())


class EpochSetter:
    """``loader.sampler``: only ``set_epoch(epoch)``, passed on to the loader. Lightning (and
    other loops written for torch's DataLoader) call it before each epoch: the loader's epoch
    stays in step with theirs, which matters when they resume from a checkpoint."""

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


def _close_dropped(run_ref: weakref.ref[Run], session: Session) -> None:
    """An epoch was dropped half-way: stop its workers on its loop, if that loop runs, or
    here and now if that loop is closed; otherwise (the sync adapter's loop between two
    calls) the next epoch, a close or the loader's backstop does it."""
    loop = session.loop
    if os.getpid() != session.owner_pid or loop is None:
        return
    if loop.is_closed():  # dropped after its loop ended (held by a traceback, say)
        _close_now(session)
        return
    if not loop.is_running():
        return

    def spawn() -> None:
        run = run_ref()
        if run is not None and run.in_epoch():
            return  # a newer epoch runs: the session is its business now
        if run is not None and run.rewinds(session):
            session.detach()  # persistent workers: the next epoch starts the pass again
            return
        closing = run.owned.drop(session) if run is not None else session.aclose()
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
    reaping runs in a thread of its own and ends by itself). Its run is left alone (we may
    be in the garbage collector, inside its lock): it drops a closed session itself."""
    if not session.closed:
        session.close(0.0)


def _show_stall(bar: Any, run: Run) -> None:
    meter = run.meter
    bar.set_postfix_str(f"data stall {meter.wait / max(meter.wall(), 1e-9):.0%}",
                        refresh=False)

