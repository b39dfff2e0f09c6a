"""Run: what a loader's epochs share over its life, and the one owner of it.

A :class:`Run` owns the session (the workers, kept between epochs), the standby processes,
the pass counters, the consumer's cursor, the resume point and a reader's cache, and says
where the loader stands::

    IDLE ──(an epoch begins)──> IN_EPOCH ──(its end)──────────────> IDLE
      ^                            ├──(all its batches taken, its pass end not)──> PASS_OWED
      |                            └──(closed early, persistent workers kept)───> REWIND_OWED
      └──(an epoch begins from PASS_OWED or CLOSED; the next one takes the pass end;
          from REWIND_OWED, the kept workers start the pass again)
    any ──(close() from any task or thread, the GC)──> CLOSING ──> CLOSED

An epoch iterator (``_epoch.Epoch``) drives it through :meth:`begin`, :meth:`next` and
:meth:`end`, and touches nothing else. A run holds no reference to its loader, so the
loader's garbage-collector backstop can stop what it owns (:class:`Owned`).
"""

from __future__ import annotations

import asyncio
import enum
import os
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from .._config import LoaderConfig, draw_seed, iterable_length
from .._errors import BatchFailure, LoaderBusyError, ResumeError, ResumeWarning
from .._loops import running_loop
from .._stats import NO_ARENA, LoaderStats, Meter
from ..pipeline._loads import SkipLog
from ..plans._distributed import any_of
from ..plans._position import is_stateful
from ..plans._reshape import cache_size
from ..plans._sources import Kind
from ..plans._state import Cursor, ResumePoint, choose, make_state, read_state
from ..workers._phases import RestartBudget
from ..workers._producers import CachedInstances
from ..workers._standby import StandbyPool
from ..workers._starting import warm_forkserver
from ..workers._steps import Delivered, PassDone, Step
from ._bars import progress_bar
from ._padding import Padding, even_refusal
from ._portal import Portal
from ._session import GRACE, Session
from ._setup import Setup


class Phase(enum.Enum):
    IDLE = "idle"  # between epochs (a session may be kept for the next)
    IN_EPOCH = "in an epoch"
    PASS_OWED = "a pass end owed"  # an epoch took all its batches, not its pass end
    REWIND_OWED = "a rewind owed"  # an epoch left early kept its workers: start it again
    CLOSING = "closing"
    CLOSED = "closed"  # nothing kept; the loader may be iterated again


class EpochHandle(Protocol):
    """What the run asks of an epoch it replaces."""

    waiting: bool  # a consumer is inside its __anext__, waiting for a batch

    def abandon(self, superseded: bool = False) -> None: ...


class Owned:
    """What a run must stop when its loader goes: its session, standbys and portal.

    Kept apart so that the loader's garbage-collector backstop holds only these: the rest
    of a run (a ``WorkerDied`` kept in its restart budget, with its traceback through the
    epoch that raised it, which holds the loader) would otherwise keep the loader alive.
    """

    def __init__(self, portal: Portal, standby: StandbyPool | None) -> None:
        self.portal = portal
        self.standby = standby
        self.session: Session | None = None
        self.owner_pid = os.getpid()

    def kill(self) -> None:
        """Stop everything, at once, without a loop; nothing in a forked child that
        inherited the loader."""
        if os.getpid() != self.owner_pid:
            return
        session, self.session = self.session, None
        if session is not None:
            session.kill()
        if self.standby is not None:
            self.standby.close(0.0)
        self.portal.close()


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
        self.phase = Phase.IDLE
        # What each batch asks of the config, read once: the epoch's length, the timeout,
        # and whether ranks agree batch by batch (streams have no length: with even_batches)
        b, topo = config.batching, config.topo
        agree = (topo.distributed and b.even_batches and b.batches_per_epoch is None
                 and config.lazy)
        self._per_batch = (b.batches_per_epoch, config.output.timeout, agree)
        self.cache: CachedInstances | None = None
        self._lock = threading.Lock()
        self._epoch: weakref.ref[EpochHandle] | None = None  # the epoch in progress
        self._produced = 0  # batches the epoch in progress handed over
        self._told: int | None = None  # an IterableDataset's len(loader), once asked
        self._next_pass = 0  # the pass the session's stream is at
        self._session_pass = 0  # the pass the current session started with
        self._cursor = Cursor()  # where the consumer stands (state_dict)
        self._resume: ResumePoint | None = None  # where the next session starts
        self._padding: Padding | None = None  # even_batches: this rank's pass is over
        warm = config.workers.warm_start
        # spawn and forkserver start their interpreters now, so that their imports overlap
        # the script's own set-up (issue 13): standbys, or the process's forkserver.
        standby = (StandbyPool(config.source, config.workers.num_workers)
                   if warm == "spawn" else None)
        # the sync adapter's loop (and the close's between epochs)
        self.owned = Owned(Portal(), standby)
        self._configure(config.seed)
        if warm == "forkserver":
            warm_forkserver(config.source)
        if self.standby is not None:
            # Imports in the background (aioloader/workers/_starting.py), unless the spec cannot be
            # pickled: then no process starts at all, and the first epoch says why.
            self.standby.start({"source": config.source, "collate_fn": config.collate_fn,
                                "options": config.batching.options,
                                "worker_init_fn": config.workers.init_fn})

    @property
    def portal(self) -> Portal:
        return self.owned.portal

    @property
    def standby(self) -> StandbyPool | None:
        return self.owned.standby

    @property
    def _session(self) -> Session | None:
        return self.owned.session

    @_session.setter
    def _session(self, session: Session | None) -> None:
        self.owned.session = session

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
            self._seed = draw_seed(self.config.given.generator)
        return self._seed

    @property
    def _setup(self) -> Setup:
        if self._made is None:
            self._made = Setup(self.config, self.seed, self.budget, self.skips, self.standby,
                               self._pads)
        return self._made

    # ------------------------------------------------------------------ epochs

    async def begin(self, epoch: EpochHandle, private: bool) -> Session:
        """``epoch`` begins: the session that serves it, attached to the running loop.

        An earlier epoch that handed over all its batches is over, even if nobody asked it
        for its end (Lightning, zip() and islice() take len(loader) batches and move on);
        one that did not is superseded, as torch's ``iter(loader)`` starts over: its
        consumer is told so if it asks again (unless it is waiting for a batch right now, in
        another task or thread: then this one is refused, LoaderBusyError), or was dropped
        (its session is started again).
        """
        full = self.delivered_all()
        with self._lock:
            current = self._epoch() if self._epoch is not None else None
            if current is not None and current is not epoch and not full and current.waiting:
                raise LoaderBusyError(
                    "this loader is being iterated by another task or thread, which is "
                    "waiting for a batch: finish or close that epoch first (`await "
                    "loader.aclose()`), or make a second DataLoader")
            dropped = self._epoch is not None  # an earlier epoch was left unfinished
            owed = self.phase is Phase.PASS_OWED or (dropped and full)
            left = self.phase is Phase.REWIND_OWED  # closed early, its workers kept
            self._epoch = weakref.ref(epoch)
            self.phase = Phase.IN_EPOCH
        if current is not None and current is not epoch:
            current.abandon(superseded=not full)
        before = self._session
        rewind = before is not None and (left or (dropped and not full and self.rewinds(before)))
        if dropped and before is not None and not full and not rewind:
            await self.drop_session(before)  # this epoch starts that one again
        live = before is not None and not before.closed and self._session is before
        streaming_on = self.config.batching.batches_per_epoch is not None
        if owed and not streaming_on and not live:
            self._pass_done()  # its pass end went with its session
        session = await self._started_session()
        session.attach(private=private)
        if rewind and session is before:  # persistent workers start the pass again
            await session.rewind(self._next_pass, self.config.output.timeout)
            self._cursor.in_pass = 0
        if owed and not streaming_on and session is before:
            session = await self._finish_pass(session, private)
        self._produced = self._cursor.begin_epoch()
        return session

    def rewinds(self, session: Session) -> bool:
        """Whether an epoch left early keeps ``session``'s workers for the next one
        (``persistent_workers=True``, as torch's): a pass of the loader's own, started
        again from its beginning, with nothing resumed."""
        c = self.config
        # A torch Dataset only: a reader's workers stop when its epoch is left early (the
        # contract's lifecycle), its persistence is for completed epochs.
        return (c.kind is Kind.MAP and c.workers.persistent
                and c.batching.batches_per_epoch is None and self._resume is None
                and session.rewinds())

    async def _finish_pass(self, session: Session, private: bool) -> Session:
        """Take the pass end that an earlier, fully consumed epoch left unasked for."""
        step = await session.next(self.config.output.timeout)
        if isinstance(step, PassDone):
            self._pass_done()
            return session
        # The epoch was longer than len() said (a sampler whose len() is off): start the
        # pass again rather than lose the batch just taken.
        session.detach()
        await self.drop_session(session)
        session = await self._started_session()
        session.attach(private=private)
        return session

    async def next(self, session: Session) -> Delivered | BatchFailure | None:
        """The epoch's next batch, counted as handed over; None at the epoch's end. A torch
        Dataset's batch whose making raised is counted too, and comes as its
        :class:`BatchFailure`: the epoch raises its error and goes on, as torch's iterator
        does."""
        limit, timeout, agree = self._per_batch
        if agree:
            return await self._even(session, timeout)
        while limit is None or self._produced < limit:
            try:
                step = await session.next(timeout)
            except BatchFailure as failed:
                if self.config.kind is not Kind.MAP:
                    # A reader's epoch ends at its first error (AllenNLP's loader, and the
                    # contract's lifecycle: its workers stop); torch's Dataset goes on.
                    raise failed.error from None
                self._produced += 1
                self._cursor.delivered()
                return failed
            if isinstance(step, PassDone):
                self._pass_done()
                if limit is None or step.empty:
                    return None
                continue
            self._produced += 1
            self._cursor.delivered()
            if self._told is not None and self._produced > self._told:
                self._past_length()
            return step
        return None

    def _past_length(self) -> None:
        """torch's warning: an IterableDataset gave more batches than ``len(loader)`` said."""
        warn = (f"Length of IterableDataset {self.config.source} was reported to be "
                f"{self._told} (when accessing len(dataloader)), but {self._produced} samples "
                "have been fetched. ")
        if self.config.workers.num_workers > 0:
            warn += ("For multiprocessing data-loading, this could be caused by not properly "
                     "configuring the IterableDataset replica at each worker: each worker must "
                     "read its own part (torch.utils.data.get_worker_info()).")
        warnings.warn(warn, stacklevel=5)

    async def end(self, epoch: EpochHandle, session: Session | None, *, stop: bool,
                  grace: float = GRACE) -> None:
        """``epoch`` ends: complete (``stop=False``: its workers stay, if the loader keeps
        them), or stopped (an error, a cancel, a close half-way)."""
        with self._lock:
            if self._epoch is not None and self._epoch() is epoch:
                self._epoch = None
                if self.phase is Phase.IN_EPOCH:
                    self.phase = Phase.IDLE
        if session is None:
            return
        if not stop:
            self._cursor.in_epoch = 0  # between epochs
            if not self.config.keeps_workers:  # persistent_workers=False: none between
                self._hold_position()
                stop = True
        if stop:
            await self.drop_session(session, grace)
        elif not session.closed:
            session.detach()

    async def leave(self, epoch: EpochHandle, session: Session | None) -> None:
        """``epoch`` is closed by its consumer: simply over if it handed over all its
        batches (its workers stay; the next epoch takes its pass end); else its workers
        stay where they would start the pass again (:meth:`rewinds`), or are stopped."""
        full = self.delivered_all()
        if session is not None and not session.closed and (full or self.rewinds(session)):
            await self.end(epoch, session, stop=False)
            with self._lock:
                if self.phase is Phase.IDLE:
                    self.phase = Phase.PASS_OWED if full else Phase.REWIND_OWED
            return
        await self.end(epoch, session, stop=session is not None)

    def is_current(self, epoch: EpochHandle) -> bool:
        return self._epoch is not None and self._epoch() is epoch

    def in_epoch(self) -> bool:
        """An epoch is in progress (not dropped, not ended)."""
        return self._epoch is not None and self._epoch() is not None

    def delivered_all(self) -> bool:
        """The current epoch handed over as many batches as it has (when that is known)."""
        in_epoch = self._cursor.in_epoch
        if not in_epoch:
            return False
        length = self.known_length()
        return length is not None and in_epoch >= length

    def known_length(self) -> int | None:
        """The epoch's length where it is known without reading anything."""
        if self.config.batching.batches_per_epoch is not None:
            return self.config.batching.batches_per_epoch
        if self.config.kind is Kind.MAP or self.cache is not None:
            return self.length()
        return None

    @property
    def in_epoch_count(self) -> int:
        """Batches of the current epoch handed over so far."""
        return self._cursor.in_epoch

    def _pass_done(self) -> None:
        self.padded += self._pads.pop(self._next_pass, 0)  # (handed over with the pass)
        self._next_pass += 1
        self._session_pass += 1
        self._cursor.pass_done()

    async def _even(self, session: Session, timeout: float | None) -> Delivered | None:
        """``even_batches`` over a stream: the epoch goes on while any rank has a batch of
        its pass, and a rank whose pass is over repeats its first batches (``_padding``);
        with ``drop_last``, it ends when the first rank's pass does (the rest is dropped)."""
        drop, pad = self.config.batching.drop_last, self._padding
        step: Step = PassDone(False) if pad is not None else await session.next(timeout)
        if pad is None and isinstance(step, PassDone) and step.empty and not drop:
            pad = self._pad()  # nothing of the pass came here: has the pass any batch?
            await pad.prime()
        has = isinstance(step, Delivered)
        some, out, stuck = await asyncio.to_thread(
            any_of, self.config.topo, [has, not has, pad is not None and pad.empty])
        if some and not (stuck or (drop and out)):
            if isinstance(step, PassDone):
                if self._padding is None:  # this rank's pass is over, not the others'
                    self._padding = pad = pad or self._pad()
                    stream = pad.stream = self._cursor.stream
                    if stream is not None:  # a state taken now: this rank's pass is over
                        self._cursor.stream = lambda: replace(stream(), pending=())
                assert pad is not None
                repeat = await pad.next()
                assert repeat is not None, "a pass with batches has a first one"
                step = repeat
                self.padded += 1
            self._produced += 1
            self._cursor.delivered()
            return step
        if stuck and some:
            warnings.warn(even_refusal(self.config.topo.rank), stacklevel=4)
        while not isinstance(step, PassDone):  # the epoch ends here for every rank
            step = await session.next(timeout)
        if self._padding is not None:
            self._cursor.stream, self._padding = self._padding.stream, None
        self._pass_done()
        return None

    def _pad(self) -> Padding:
        return Padding(lambda: self._setup.producer(self._next_pass, None, None),
                       self.config.workers.num_workers, self.config.output.timeout)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._next_pass:
            self._next_pass = epoch
            self._resume = None  # a resumed position belongs to its own epoch
            self._cursor = Cursor(pass_no=epoch)

    # ------------------------------------------------------------------ sessions

    async def _started_session(self) -> Session:
        """The session for the next epoch, started; a new one when the pass moved."""
        session = self._session
        if session is not None and (session.closed or self._session_pass != self._next_pass):
            await self.drop_session(session)
            session = None
        if session is None:
            resume, self._resume = self._resume, None
            if resume is not None and resume.pass_no != self._next_pass:
                resume = None
            cache = await self.ensure_cache() if self.config.cached else None
            producer = self._setup.producer(self._next_pass, resume, cache)
            session = Session(producer)
            self._session = session
            self._padding = None
            self._session_pass = self._next_pass
            with self._lock:
                carried = self._cursor.carried if resume is not None else None
                self._cursor = Cursor(self._next_pass, resume.in_pass if resume else 0,
                                      stream=getattr(producer, "position", None),
                                      carried=carried,
                                      history=resume.history if resume else ())
            await session.start()
        return session

    async def drop_session(self, session: Session, grace: float = GRACE) -> None:
        with self._lock:
            if self._session is session:
                self._session = None
        await session.aclose(grace)

    # ------------------------------------------------------------------ reading

    def length(self) -> int:
        """len(loader): batches per epoch (a cached reader is read for it, once)."""
        c = self.config
        if c.batching.batches_per_epoch is not None:
            return c.batching.batches_per_epoch
        if c.kind is Kind.MAP:
            return self._setup.count(c.source)
        if c.kind is Kind.ITERABLE and c.lazy and c.given.max_instances_in_memory is None:
            # torch keeps the dataset's own len() and warns when more batches than that
            # have come: its comparison, kept as it is.
            self._told = len(c.source)
            return iterable_length(c.source, c.batching)
        if c.lazy:
            raise TypeError(
                "a lazy loader (max_instances_in_memory set) does not know its length: pass "
                "batches_per_epoch, or leave max_instances_in_memory=None to cache the data")
        cache = self.cache
        if cache is None:
            cache = self.portal.call(self.ensure_cache())
        return self._setup.count(cache)

    async def instances(self) -> AsyncIterator[Any]:
        """The instances of one pass, unbatched (cached mode fills its cache on the way)."""
        c = self.config
        if c.kind is Kind.MAP:
            for i in range(len(c.source)):
                yield c.source[i]
            return
        if self.cache is not None:
            for item in self.cache:
                yield item
            return
        items: list[Any] = []
        async for chunk in self._read_pass():
            if c.cached:
                items.extend(chunk)
            for item in chunk:
                yield item
        if c.cached:
            self.cache = CachedInstances(items)

    async def ensure_cache(self) -> CachedInstances:
        if self.cache is None:
            items: list[Any] = []
            with progress_bar(self.config.output.quiet, desc="loading instances",
                              unit="instance") as bar:
                async for chunk in self._read_pass():
                    items.extend(chunk)
                    bar.update(len(chunk))
            self.cache = CachedInstances(items)
        return self.cache

    async def _read_pass(self) -> AsyncIterator[list[Any]]:
        """One pass of instances, in chunks: in this process, or through workers (sharded)."""
        session = Session(self._setup.instances(self._next_pass))
        with self._lock:  # a close() while the cache fills must reach this session
            held = self._session is None
            if held:
                self._session = session
        try:
            await session.start()
            session.attach()
            while True:
                step = await session.next(self.config.output.timeout)
                if isinstance(step, PassDone):
                    return
                yield step.value
        finally:
            with self._lock:
                if held and self._session is session:
                    self._session = None
            await session.aclose()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        if c.lazy and c.loads is not None and not c.loads.ordered and (
                c.batching.options.sampler is not None):
            raise ResumeError(
                "state_dict() with ordered=False and a BatchSampler: loads finish out of "
                "order and the sampler's blocks depend on their instances, so no position "
                "says what was delivered. Use ordered=True to checkpoint (loads still "
                "overlap), or shuffle= without a BatchSampler")
        with self._lock:
            cursor = self._cursor
        return make_state(self.config.fingerprint(), self.seed, cursor, self._cached_count())

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        c = self.config
        shards = c.shape_shards
        states = [state] if isinstance(state, Mapping) or not isinstance(
            state, Sequence) or not state else list(state)
        points = [read_state(s, c.fingerprint(), seed=c.given.seed, stream=c.lazy)
                  for s in states]
        point = choose(points, rank=c.topo.rank, world_size=c.topo.world_size, shards=shards,
                       refusal=self._setup.reshape_refusal(),
                       reframe=self._setup.reframe if c.lazy else None)
        with self._lock:
            if self.in_epoch():
                raise LoaderBusyError(
                    "load_state_dict() while an epoch is being iterated: finish or close "
                    "that epoch first (`loader.close()`), then load the state")
        # Workers that persisted from an earlier epoch are elsewhere; standbys hold nothing
        # of it and stay for the next session.
        self.close_session()
        if point.seed != self._seed:
            self._configure(point.seed)
        self._resume = point
        self.phase = Phase.IDLE  # the state says where the next epoch starts: nothing owed
        self._next_pass = point.pass_no
        # (a state taken before the next session starts is this one: a stream's position
        # with it, or a stream resumed on a new shape would start its pass again)
        stream = point.stream
        self._cursor = Cursor(point.pass_no, point.in_pass, point.in_epoch,
                              stream=(lambda: stream) if stream is not None else None,
                              carried=point.in_epoch, history=point.history)
        if point.stream is not None and not is_stateful(c.source) and c.loads is None:
            skipped = sum(p.start.raw for p in point.stream.shards)
            if skipped:
                warnings.warn(
                    f"resuming {type(c.source).__name__} by reading and skipping {skipped} "
                    "instances: it has no state_dict()/load_state_dict() of its own. Give it "
                    "those (a position in its files) to resume in constant time",
                    ResumeWarning, stacklevel=3)

    def _hold_position(self) -> None:
        """A completed epoch is about to stop its workers (``persistent_workers=False``):
        with ``batches_per_epoch`` the stream goes on where it stopped, so the next session
        starts there, as after :meth:`load_state_dict`."""
        if self.config.batching.batches_per_epoch is None:
            return  # the next epoch starts a pass of its own
        with self._lock:
            cursor = self._cursor
        topo = self.config.topo
        self._resume = ResumePoint(
            seed=self.seed, pass_no=cursor.pass_no, in_pass=cursor.in_pass, in_epoch=0,
            stream=cursor.stream() if cursor.stream is not None else None,
            instances=self._cached_count(), history=cursor.history, rank=topo.rank,
            world_size=topo.world_size, shards=self.config.shape_shards)

    def _cached_count(self) -> int | None:
        if not self.config.cached:
            return None
        if self.cache is not None:
            return len(self.cache)
        # A state taken after load_state_dict(), before the cache is read again: the
        # count the resume point says (a new rank's share, on a new shape)
        point, topo = self._resume, self.config.topo
        return None if point is None else cache_size(point.instances, point.history,
                                                     topo.rank, topo.world_size,
                                                     self.config.shards)

    def stats(self) -> LoaderStats:
        session = self._session
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
        self._closing()
        try:
            if self.standby is not None:
                await asyncio.to_thread(self.standby.close)
            session = self._take_session()
            if session is None:
                return
            if session.loop is None or session.loop is running_loop():
                await session.aclose()
            else:
                await asyncio.to_thread(self._stop, session)
        finally:
            self._closed()

    def close(self) -> None:
        """Blocking :meth:`aclose`, from any thread; also ends the portal's loops."""
        self._closing()
        try:
            if self.standby is not None:
                self.standby.close()
            self.close_session()
        finally:
            self._closed()

    def close_session(self) -> None:
        """Stop the session (the standbys stay), and the portal's loops."""
        session = self._take_session()
        if session is not None:
            self._stop(session)
        self.portal.close()

    def _stop(self, session: Session) -> None:
        """Close ``session`` from this thread, on the loop it is attached to."""
        loop, here = session.loop, running_loop()
        if loop is None and here is None:  # between epochs: an async reader's pass
            self.portal.call(session.aclose())  # closes on a loop
        elif loop is None or loop is here:
            session.close()  # from async code on its own loop: blocks it while reaping
        elif loop is self.portal.loop:  # the sync adapter's, driven in bursts
            self.portal.call(session.aclose())
        elif loop.is_running():  # a user's loop, or the portal's own thread
            asyncio.run_coroutine_threadsafe(session.aclose(), loop).result()
        else:
            session.close()

    def _closing(self) -> None:
        with self._lock:
            if self.phase is Phase.PASS_OWED and self.config.batching.batches_per_epoch is None:
                self._pass_done()  # the pass end goes with its session: the pass is over
            self.phase = Phase.CLOSING

    def _closed(self) -> None:
        with self._lock:
            if self.phase is Phase.CLOSING:
                self.phase = Phase.CLOSED

    def _take_session(self) -> Session | None:
        with self._lock:
            session, self._session = self._session, None
            self._epoch = None
        return session

    def session_is(self, session: Session) -> bool:
        return self._session is session
