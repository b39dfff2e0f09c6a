"""Run: what a loader's epochs share over its life, and the one owner of it.

Its :class:`~aioloader.run._phase.Phase` changes only through :meth:`Run._move`, under the
run's lock (docs/architecture.md, "The run" and "The run's phase"). A run holds no reference
to its loader, so the loader's garbage-collector backstop can stop what it owns (:class:`Owned`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from .._config import LoaderConfig, draw_seed
from .._errors import BatchFailure, LoaderBusyError, LoaderClosedError
from .._stats import NO_ARENA, LoaderStats, Meter
from ..pipeline._loads import SkipLog
from ..plans._sources import Kind
from ..plans._state import Cursor, ResumePoint
from ..workers._phases import RestartBudget
from ..workers._standby import StandbyPool
from ..workers._starting import warm_forkserver
from ..workers._steps import Delivered, PassDone
from ._checkpoint import cached_count, held_point, point_of, resumed_cursor, state_of, warn_skipping
from ._owned import Owned
from ._padding import Even
from ._phase import Event, Phase, advance
from ._portal import Portal
from ._reading import Reading
from ._session import GRACE, Session
from ._setup import Setup

_OWING = (Phase.ALL_HANDED, Phase.PASS_OWED)  # an epoch's pass end is owed


class EpochHandle(Protocol):
    """What the run asks of an epoch it replaces."""

    waiting: bool  # a consumer is inside its __anext__, waiting for a batch

    def abandon(self, superseded: bool = False) -> None: ...


class Run:
    """The epochs of one loader (see the module docstring)."""

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config
        self.budget = RestartBudget(config.workers.max_restarts)  # across sessions
        self.skips = SkipLog()  # across sessions
        self.padded = 0  # batches repeated to keep the ranks in step (even_batches)
        self._pads: dict[int, int] = {}  # a cached reader's, planned: by pass
        self.meter = Meter()
        self.next_log = 0.0  # log_every: when the next stats line is due
        self.phase = Phase.IDLE  # changed by _move alone
        self._closers = 0  # closes running (CLOSING until the last is over)
        # What each batch asks of the config, read once: the epoch's length, the timeout,
        # and whether ranks agree batch by batch (streams have no length: with even_batches)
        b, topo = config.batching, config.topo
        agree = (topo.distributed and b.even_batches and b.batches_per_epoch is None
                 and config.lazy)
        self._per_batch = (b.batches_per_epoch, config.output.timeout, agree)
        self._streaming_on = b.batches_per_epoch is not None  # an epoch is not a pass
        self._lock = threading.Lock()
        self._epoch: weakref.ref[EpochHandle] | None = None  # set in IN_EPOCH, ALL_HANDED
        self._produced = 0  # batches the epoch in progress handed over
        self.epoch_length: int | None = None  # the epoch in progress's, where known
        self._next_pass = 0  # the pass the session's stream is at
        self._session_pass = 0  # the pass the current session started with
        self._cursor = Cursor()  # where the consumer stands (state_dict)
        self._resume: ResumePoint | None = None  # where the next session starts
        self._even = Even(config, lambda: self._setup.producer(self._next_pass, None, None))
        warm = config.workers.warm_start
        # spawn and forkserver start their interpreters now, so that their imports overlap
        # the script's own set-up (issue 13): standbys, or the process's forkserver.
        standby = (StandbyPool(config.source, config.workers.num_workers)
                   if warm == "spawn" else None)
        self.owned = Owned(Portal(), standby, self._lock)
        self.reading = Reading(config, self.owned, lambda: self._setup,
                               lambda: self._next_pass)
        self._iterators = self._drawn = 0  # epochs begun; draws from `generator` made
        self._configure(config.seed)
        if warm == "forkserver":
            warm_forkserver(config.source)
        if standby is not None:
            # Imports in the background (aioloader/workers/_starting.py), unless the spec
            # cannot be pickled: then no process starts at all, and the first epoch says why.
            standby.start({"source": config.source, "collate_fn": config.collate_fn,
                           "options": config.batching.options,
                           "worker_init_fn": config.workers.init_fn})

    def _configure(self, seed: int | None) -> None:
        """What depends on the seed: the plans and the workers' setup. None: the seed is
        drawn from torch's default generator (or the loader's ``generator``) when first
        needed, as torch draws its base seed when an iterator starts, so that
        ``torch.manual_seed(s)`` anywhere before the first epoch reproduces the run."""
        self._seed = seed
        self._made: Setup | None = None

    @property
    def seed(self) -> int:
        if self._seed is None:
            self._draw()
        assert self._seed is not None
        return self._seed

    def _draw(self) -> None:
        """One draw from ``generator`` (or torch's default one); the first is the seed."""
        drawn = draw_seed(self.config.arguments["generator"])
        self._seed = drawn if self._seed is None else self._seed
        self._drawn += 1

    def _draw_as_torch(self) -> None:
        """torch draws a base seed from ``generator`` (or the default generator) for each
        iterator it makes: every epoch, the first only with persistent workers. So does this
        loader (the first draw is its seed), so that a sampler drawing from the same
        generator (``RandomSampler`` without one) gives torch's order in every epoch."""
        c = self.config
        if c.arguments["seed"] is not None:
            return
        self._iterators += 1
        persistent = c.workers.persistent and c.workers.num_workers > 0
        while self._drawn < (1 if persistent else self._iterators):
            self._draw()

    @property
    def _setup(self) -> Setup:
        if self._made is None:
            self._made = Setup(self.config, self.seed, self.budget, self.skips, self.owned.standby,
                               self._pads)
        return self._made

    # ------------------------------------------------------------------ the phase

    def _move(self, event: Event) -> Phase:
        """The one way the phase changes: by the table, or :class:`PhaseError`. The caller
        holds the run's lock (and writes what goes with the move under it)."""
        assert self._lock.locked(), "the run's phase moves under its lock"
        self.phase = advance(self.phase, event)
        if self.phase not in (Phase.IN_EPOCH, Phase.ALL_HANDED):
            self._epoch = None  # no epoch is current outside those two
        return self.phase

    def _pay(self) -> None:
        """The owed pass end, counted without reading it (its session is gone or going),
        unless set_epoch() made another pass the next one since."""
        if not self._streaming_on and self._session_pass == self._next_pass:
            self._pass_done()

    # ------------------------------------------------------------------ epochs

    async def begin(self, epoch: EpochHandle, private: bool) -> Session:
        """``epoch`` begins: the session that serves it, attached to the running loop. What
        it does is the phase's (docs/architecture.md, "The run's phase"); over an epoch
        that waits for a batch right now, in another task or thread, it is refused."""
        with self._lock:
            self.owned.adopt()
            phase = self.phase
            if phase is Phase.CLOSING:
                raise LoaderClosedError(
                    "the loader is being closed (close()/aclose() in another task or "
                    "thread): iterate it again once that close has returned")
            current = self._epoch() if self._epoch is not None else None
            if current is epoch:
                current = None
            if phase is Phase.IN_EPOCH and current is not None and current.waiting:
                raise LoaderBusyError(
                    "this loader is being iterated by another task or thread, which is "
                    "waiting for a batch: finish or close that epoch first (`await "
                    "loader.aclose()`), or make a second DataLoader")
            self._move(Event.BEGIN)
            self._epoch = weakref.ref(epoch)
        self._draw_as_torch()
        if current is not None:
            current.abandon(superseded=phase is Phase.IN_EPOCH)
        before = self.owned.session
        if phase is Phase.IN_EPOCH and before is not None:  # one was left half-way
            if self.rewinds(before):
                phase = Phase.REWIND_OWED
            else:
                await self.owned.drop(before)  # this epoch starts that pass again
        live = before is not None and not before.closed and self.owned.session is before
        if phase in _OWING and not live:
            self._pay()  # its pass end went with its session
        session = await self._started_session(private)
        if session is before and phase is Phase.REWIND_OWED:  # persistent workers
            await session.rewind(self._next_pass, self.config.output.timeout)
            self._cursor.in_pass = 0
        elif session is before and phase in _OWING and not self._streaming_on:
            session = await self._finish_pass(session, private)
        self._produced = self._cursor.begin_epoch()
        self.epoch_length = self.reading.known_length()
        return session

    def rewinds(self, session: Session) -> bool:
        """Whether an epoch left early keeps ``session``'s workers for the next one
        (``persistent_workers=True``, as torch's): a pass of the loader's own, started
        again from its beginning, with nothing resumed."""
        c = self.config
        # torch's datasets only: a reader's workers stop when its epoch is left early (the
        # contract's lifecycle), its persistence is for completed epochs. Ranks that agree
        # on a stream's steps (even_batches) start it again on new workers.
        return (c.kind is not Kind.READER and c.workers.persistent
                and c.batching.batches_per_epoch is None and self._resume is None
                and not self._per_batch[2] and session.rewinds())

    async def _finish_pass(self, session: Session, private: bool) -> Session:
        """Take the pass end that an earlier, fully consumed epoch left unasked for."""
        step = await session.next(self.config.output.timeout)
        if isinstance(step, PassDone):
            self._pass_end()
            return session
        # The epoch was longer than len() said (a sampler whose len() is off): start the
        # pass again rather than lose the batch just taken.
        session.detach()
        await self.owned.drop(session)
        return await self._started_session(private)

    async def next(self, session: Session) -> Delivered | BatchFailure | None:
        """The epoch's next batch, counted as handed over; None at the epoch's end. A torch
        Dataset's (or IterableDataset's) batch whose making raised is counted too, and
        comes as its :class:`BatchFailure`: the epoch raises its error and goes on, as
        torch's iterator does."""
        limit, timeout, agree = self._per_batch
        if agree:  # even_batches over a stream
            try:
                even, repeat = await self._even.next(session, self._cursor)
            except BatchFailure as failed:  # the ranks agree step by step: the epoch ends
                raise failed.error from None
            if even is None:
                self._pass_end()
                return None
            if repeat:
                self.padded += 1
            self._handed()
            return even
        while limit is None or self._produced < limit:
            try:
                step = await session.next(timeout)
            except BatchFailure as failed:
                if self.config.kind is Kind.READER:
                    # A reader's epoch ends at its first error (AllenNLP's loader, and the
                    # contract's lifecycle: its workers stop); torch's datasets go on.
                    raise failed.error from None
                self._handed()
                return failed
            if isinstance(step, PassDone):
                self._pass_end()
                if limit is None or step.empty:
                    return None
                continue
            self._handed()
            self.reading.check_told(self._produced)
            return step
        return None

    def _handed(self) -> None:
        """A batch is handed over: counted, and the epoch's last one (as many as its length
        says) moves the phase to ALL_HANDED, here and nowhere else."""
        self._produced += 1
        self._cursor.delivered()
        if self.epoch_length is not None and self._cursor.in_epoch >= self.epoch_length:
            with self._lock:
                if self._epoch is not None:  # (not after a close from another thread)
                    self._move(Event.LAST_BATCH)

    def _pass_end(self) -> None:
        """The current epoch takes its pass end. After a close from another thread, the
        close has counted an owed one already: nothing is counted twice."""
        with self._lock:
            if self._epoch is None:
                return
            self._move(Event.PASS_END)
        self._pass_done()

    async def end(self, epoch: EpochHandle, session: Session | None, *, stop: bool,
                  grace: float = GRACE) -> None:
        """``epoch`` ends: complete (``stop=False``: its workers stay, if the loader keeps
        them), or stopped (an error, a cancel, a close half-way)."""
        with self._lock:
            if self.is_current(epoch):
                self._move(Event.END)
        await self._release(session, stop=stop, grace=grace)

    async def leave(self, epoch: EpochHandle, session: Session | None) -> None:
        """``epoch`` is closed by its consumer: after its last batch (ALL_HANDED), its
        pass end is owed and its workers stay as after a complete epoch; half-way, its
        workers stay where they would start the pass again (:meth:`rewinds`), or stop."""
        with self._lock:
            kept = False
            if self.is_current(epoch):
                kept = (self.phase is Phase.IN_EPOCH and session is not None
                        and self.rewinds(session))
                kept = self._move(Event.KEEP if kept else Event.LEAVE) is not Phase.IDLE
        await self._release(session, stop=not kept)

    async def _release(self, session: Session | None, *, stop: bool,
                       grace: float = GRACE) -> None:
        """What an epoch that is over leaves of ``session``: kept (detached) for the next
        one, or stopped (``stop``, or workers that are not kept between epochs)."""
        if session is None:
            return
        if not stop:
            self._cursor.in_epoch = 0  # between epochs
            if not self.config.keeps_workers:  # persistent_workers=False: none between
                self._hold_position()
                stop = True
        if stop:
            await self.owned.drop(session, grace)
        elif not session.closed:
            session.detach()

    def is_current(self, epoch: EpochHandle) -> bool:
        return self._epoch is not None and self._epoch() is epoch

    def in_epoch(self) -> bool:
        """An epoch is in progress (not dropped, not ended)."""
        return self._epoch is not None and self._epoch() is not None

    @property
    def in_epoch_count(self) -> int:
        """Batches of the current epoch handed over so far."""
        return self._cursor.in_epoch

    def _pass_done(self) -> None:
        self.padded += self._pads.pop(self._next_pass, 0)  # (handed over with the pass)
        self._next_pass += 1
        self._session_pass += 1
        self._cursor.pass_done()

    def set_epoch(self, epoch: int) -> None:
        """Make pass ``epoch`` the next one (an owed pass end or rewind is then void)."""
        with self._lock:
            if epoch == self._next_pass:
                return
            self._move(Event.SET_EPOCH)
            self._next_pass = epoch
            self._resume = None  # a resumed position belongs to its own epoch
            self._cursor = Cursor(pass_no=epoch)

    # ------------------------------------------------------------------ sessions

    async def _started_session(self, private: bool) -> Session:
        """The session for the next epoch, started and attached (``private``: to the sync
        adapter's loop); a new one when the pass moved."""
        session = self.owned.session
        if session is not None and (session.closed or self._session_pass != self._next_pass):
            await self.owned.drop(session)
            session = None
        if session is None:
            resume, self._resume = self._resume, None
            if resume is not None and resume.pass_no != self._next_pass:
                resume = None
            cache = await self.reading.ensure_cache() if self.config.cached else None
            producer = self._setup.producer(self._next_pass, resume, cache)
            session = Session(producer)
            self.owned.session = session
            self._even.repeats = None
            self._session_pass = self._next_pass
            with self._lock:
                carried = self._cursor.carried if resume is not None else None
                self._cursor = Cursor(self._next_pass, resume.in_pass if resume else 0,
                                      stream=getattr(producer, "position", None),
                                      carried=carried,
                                      history=resume.history if resume else ())
            await session.start()
        session.attach(private=private)
        return session

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            cursor = self._cursor
        return state_of(self.config, self.seed, cursor, self._cached_count())

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Where the next epoch starts: checked first (the run unchanged on an error), then
        the phase, the pass, the cursor and the seed written together under the lock."""
        point = point_of(self.config, self._setup, state)
        with self._lock:
            if self.in_epoch() or self.phase is Phase.CLOSING:
                raise LoaderBusyError(
                    "load_state_dict() while an epoch is being iterated (or a close runs): "
                    "finish or close that epoch first (`loader.close()`), then load the state")
            self._move(Event.LOAD)  # the state says where the next epoch starts: nothing owed
            # Workers that persisted from an earlier epoch are elsewhere; standbys hold
            # nothing of it and stay for the next session.
            session, self.owned.session = self.owned.session, None
            if point.seed != self._seed:
                self._configure(point.seed)
            self._resume = point
            self._next_pass = point.pass_no
            self._cursor = resumed_cursor(point)
        if session is not None:
            self.owned.stop(session)
        self.owned.portal.close()
        warn_skipping(self.config, point)

    def _hold_position(self) -> None:
        """A completed epoch is about to stop its workers (``persistent_workers=False``):
        with ``batches_per_epoch`` the stream goes on where it stopped, so the next session
        starts there, as after :meth:`load_state_dict`."""
        if self._streaming_on:
            with self._lock:
                cursor = self._cursor
            self._resume = held_point(self.config, self.seed, cursor, self._cached_count())

    def _cached_count(self) -> int | None:
        return cached_count(self.config, self.reading.cache, self._resume)

    def stats(self) -> LoaderStats:
        session = self.owned.session
        workers, arena = session.producer.stats() if session is not None else ((), NO_ARENA)
        meter = self.meter
        wall = meter.wall()
        return LoaderStats(
            batches=meter.batches, bytes=meter.bytes, wait_s=meter.wait, wall_s=wall,
            data_stall=meter.wait / wall if wall > 0 else 0.0,
            time_to_first_batch_s=meter.first, workers=workers, arena=arena,
            restarts=self.budget.restarts, recycles=self.budget.recycles,
            skipped=len(self.skips.skipped), padded=self.padded,
            crashes=self.budget.healed.get("crash", 0), hangs=self.budget.healed.get("hang", 0))

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        """Stop the workers, on the loop they are attached to, without blocking this one."""
        with self._closing():
            await self.owned.aclose()

    def close(self) -> None:
        """Blocking :meth:`aclose`, from any thread; also ends the portal's loops."""
        with self._closing():
            self.owned.close()

    @contextlib.contextmanager
    def _closing(self) -> Iterator[None]:
        """A close runs: no epoch is current any more, and one whose batches were all handed
        over has its pass end counted (it goes with its session); the last close running
        makes the run CLOSED."""
        with self._lock:
            if self.phase in _OWING:
                self._pay()
            self._move(Event.CLOSE)
            self._closers += 1
        try:
            yield
        finally:
            with self._lock:
                self._closers -= 1
                if self._closers == 0:
                    self._move(Event.CLOSED)
