"""DataLoader: options, validation, the two faces, and one epoch of iteration."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.data

from ._device import DeviceLike, as_device, can_pin
from ._distributed import all_reduce, topology
from ._epoch import Epoch, backstop, progress_bar
from ._errors import LoaderBusyError, ResumeError, ResumeWarning
from ._loads import Retry, SkipLog, SkippedLoad
from ._loops import running_loop
from ._options import check_arguments
from ._options import validate_worker_nice as validate_worker_nice  # the bench's import
from ._pipeline import BatchOptions
from ._planning import PlanSpec, Sharding, count_batches, plan_epoch, sharding, worker_seed
from ._position import StreamPosition, is_stateful
from ._producers import CachedInstances, Plan
from ._samplers import BatchSampler
from ._session import GRACE, PassDone, Producer, Session
from ._setup import Setup
from ._sources import Kind
from ._standby import StandbyPool
from ._state import Cursor, ResumePoint, make_state, read_state
from ._stats import NO_ARENA, LoaderStats, Meter
from ._supervisor import RestartBudget, warm_forkserver
from ._sync import Portal, SyncLoader


class _Box:
    """What a loader owns that must be stopped when it goes: its session, its portal, and
    (spawn) its standby processes until a session takes them.

    Kept apart from the loader so that the garbage collector's backstop
    (``weakref.finalize``) can stop them; it does so only in the process that made them.
    """

    def __init__(self) -> None:
        self.session: Session | None = None
        self.portal = Portal()
        self.standby: StandbyPool | None = None
        self.owner_pid = os.getpid()

    def kill(self) -> None:
        if os.getpid() != self.owner_pid:
            return  # a forked child inherited the loader: nothing here is its own
        session, self.session = self.session, None
        if session is not None:
            session.kill()
        if self.standby is not None:
            self.standby.close(0.0)
        self.portal.close()


class DataLoader:
    """Batches from a reader or dataset, built in worker processes, consumed with ``async for``.

    torch's ``DataLoader`` arguments are accepted with torch's meaning (docs/migrating.md):
    ``sampler`` (map-style; batched as ``BatchSampler(sampler, batch_size, drop_last)``),
    ``worker_init_fn`` (once per worker process, after seeding), ``prefetch_factor`` (our
    ``prefetch``: batches in flight per worker), ``generator`` (the seed when ``seed`` is
    None), ``multiprocessing_context`` (our ``start_method``), ``pin_memory``, ``timeout=0``
    (no timeout), ``in_order`` (True or False: batches of a map-style dataset always come
    in the sampler's order, and a slow worker holds up no more than torch's in-order
    delivery would). A worker's exception is raised as :class:`~aioloader.WorkerError` that
    is also of the original's type, so ``except KeyError:`` works as with torch.

    ``persistent_workers=True`` (torch's default is False) keeps the workers, their shared
    memory and their place in the stream from one completed epoch to the next: no process
    start per epoch, and the next epoch is prepared while this one ends. torch defaults to
    False because its workers hold an iterator's state; ours take a plan per epoch, so
    keeping them costs nothing. ``False`` stops them when each epoch completes (nothing is
    left running between epochs; each epoch starts its workers, and ``worker_init_fn``
    runs again, as with torch).

    ``worker_type="thread"`` runs the workers as threads of this process instead: the same
    sessions and API, but batches are handed over by reference (no shared memory, no copy),
    ``start_method`` does not apply, the workers share this process's RNGs (they do not
    reseed them; ``get_worker_info().seed`` is still per worker) and, as threads cannot be
    killed or recycled, ``max_worker_restarts``, ``max_batches_per_worker`` and
    ``max_worker_rss`` are refused. Pick it where processes are costly (start-up, a forked
    copy of a large dataset, pickling), for I/O, or on free-threaded Python; with the GIL,
    processes won or tied on throughput in every workload measured (docs/performance.md).

    ``worker_nice`` (0 to 19, default 0) lowers the worker processes' CPU priority by that
    much (``os.nice`` in each, restarted and recycled ones too): where the workers keep
    every core busy, the consumer's process then gets a core as soon as it wakes, instead
    of waiting out a worker's time slice. On 2 cores with 2 busy workers, 19 took the p99
    lag of a 1 ms ticker in the consumer's event loop from 3-4 ms to about 1.1 ms at the
    same throughput. It is not the default because the workers then also yield to every
    other process of this machine at normal priority (docs/performance.md).

    ``quiet=None`` (the default) follows tqdm's convention: a progress bar for each epoch
    (and for reading a reader into its cache) when stderr is a terminal or in a Jupyter
    notebook, nothing when stderr is redirected (logs, CI), as torch prints nothing. It is
    decided as each bar starts. ``quiet=True`` never shows bars; ``quiet=False`` always does.

    Examples:
        >>> import aioloader
        >>> class Squares(aioloader.Reader):
        ...     def read(self, data_path):
        ...         for i in range(6):
        ...             yield {"x": i, "y": i * i}
        >>> loader = aioloader.DataLoader(Squares(), batch_size=4, quiet=True)
        >>> [b["y"].tolist() for b in loader]
        [[0, 1, 4, 9], [16, 25]]
    """

    def __init__(
        self,
        reader: Any,
        data_path: Any = None,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        shuffle: bool = False,
        batch_sampler: Any = None,
        batches_per_epoch: int | None = None,
        num_workers: int = 0,
        max_instances_in_memory: int | None = None,
        start_method: str = "fork",
        worker_type: str = "process",
        worker_nice: int = 0,
        cuda_device: DeviceLike | None = None,
        quiet: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        prefetch: int | None = None,
        even_batches: bool = True,
        zero_copy: bool = True,
        max_worker_restarts: int = 0,
        max_batches_per_worker: int | None = None,
        max_worker_rss: int | None = None,
        log_every: float | None = None,
        load_fn: Callable[[Any], Any] | None = None,
        concurrency: int | None = None,
        ordered: bool = True,
        retries: int | Retry = 0,
        on_error: str = "raise",
        sampler: Any = None,
        worker_init_fn: Callable[[int], object] | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int | None = None,
        generator: torch.Generator | None = None,
        in_order: bool = True,
        multiprocessing_context: Any = None,
        pin_memory: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        args = check_arguments(
            reader, data_path, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
            batch_sampler=batch_sampler, batches_per_epoch=batches_per_epoch,
            num_workers=num_workers, max_instances_in_memory=max_instances_in_memory,
            start_method=start_method, worker_type=worker_type, worker_nice=worker_nice,
            cuda_device=cuda_device, quiet=quiet, collate_fn=collate_fn, seed=seed,
            timeout=timeout, prefetch=prefetch, even_batches=even_batches,
            zero_copy=zero_copy, max_worker_restarts=max_worker_restarts,
            max_batches_per_worker=max_batches_per_worker, max_worker_rss=max_worker_rss,
            log_every=log_every, load_fn=load_fn, concurrency=concurrency, ordered=ordered,
            retries=retries, on_error=on_error, sampler=sampler, worker_init_fn=worker_init_fn,
            persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
            generator=generator, in_order=in_order,
            multiprocessing_context=multiprocessing_context, pin_memory=pin_memory,
            pin_memory_device=pin_memory_device)
        # As checked: numpy integers as ints, torch's spellings as ours.
        batch_size, shuffle, num_workers, seed = (args.batch_size, args.shuffle,
                                                  args.num_workers, args.seed)
        max_instances_in_memory, start_method = args.max_instances_in_memory, args.start_method
        max_worker_restarts = args.max_worker_restarts
        self._kind, self._loads = args.kind, args.loads
        self.reader = reader
        self.data_path = data_path
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self._user_sampler = sampler
        if sampler is not None:
            # torch's auto-batching, and the path a user's batch sampler takes (planned when
            # its epoch starts, never split again across ranks): no second planner.
            assert batch_size is not None  # checked: batch_size or batch_sampler
            batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
        self.batch_sampler = batch_sampler
        self.batches_per_epoch = args.batches_per_epoch
        self.num_workers = num_workers
        self.max_instances_in_memory = max_instances_in_memory
        self.start_method = start_method
        self.worker_type = worker_type
        self.worker_nice = args.worker_nice
        self.quiet = quiet
        self.collate_fn = collate_fn
        self.seed = seed
        self.timeout = args.timeout
        self.prefetch = args.prefetch
        self.even_batches = even_batches
        self.zero_copy = zero_copy
        self.max_worker_restarts = max_worker_restarts
        self.max_batches_per_worker = args.max_batches_per_worker
        self.max_worker_rss = args.max_worker_rss
        self.load_fn = load_fn
        self.concurrency = self._loads.concurrency if self._loads is not None else None
        self.ordered = ordered
        self.retries = args.retries
        self.on_error = on_error
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.generator = generator
        self.in_order = in_order
        self.multiprocessing_context = multiprocessing_context
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self._pin = pin_memory and _pinning_available(pin_memory_device)
        self._budget = RestartBudget(max_worker_restarts)  # across sessions: per loader
        self._skips = SkipLog()  # across sessions: per loader
        self.log_every = log_every
        self._meter = Meter()
        self._next_log = 0.0
        if log_every is not None:
            _stats_to_stderr()
        self._device = args.device
        self._topo = topology(even_batches)
        if seed is None and generator is not None:
            # torch's base seed: one draw from the user's generator.
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        if seed is None:
            # Ranks must agree on one shuffle; like DistributedSampler, default to seed 0.
            seed = 0 if self._topo.distributed else random.SystemRandom().getrandbits(63)
        self._options = BatchOptions(
            batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
            sampler=batch_sampler if isinstance(batch_sampler, BatchSampler) else None,
            chunk_size=max_instances_in_memory)
        self._box = _Box()
        # spawn and forkserver start their interpreters now, so that their imports overlap
        # the script's own set-up (issue 13): standbys, or the process's forkserver.
        warm = start_method if num_workers > 0 and worker_type == "process" else None
        if warm == "spawn":
            self._box.standby = StandbyPool(reader, num_workers)  # started below
        self._configure(seed)
        self._cache: CachedInstances | None = None
        self._next_pass = 0  # the pass the session's stream is at
        self._session_pass = 0  # the pass the current session started with
        self._lock = threading.Lock()
        self._epoch: weakref.ref[Epoch] | None = None  # the epoch in progress, if any
        self._cursor = Cursor()  # where the consumer stands (state_dict)
        self._owed_end = False  # an epoch took all its batches but not its pass end
        self._resume: ResumePoint | None = None  # where the next session starts
        if warm == "forkserver":
            warm_forkserver(reader)
        backstop(self, self._box.kill)
        if self._box.standby is not None:
            # Imports in the background (aioloader/_standby.py), unless the spec cannot be
            # pickled: then no process starts at all, and the first epoch says why.
            self._box.standby.start({"source": reader, "collate_fn": collate_fn,
                                     "options": self._options,
                                     "worker_init_fn": worker_init_fn})

    def _configure(self, seed: int) -> None:
        """What depends on the seed: the plans and the workers' setup."""
        self._base_seed = seed
        wrapped = self._user_sampler is not None  # batch_size/drop_last are in the sampler
        self._plan_spec = PlanSpec(
            batch_size=None if wrapped else self.batch_size,
            drop_last=False if wrapped else self.drop_last, shuffle=self.shuffle,
            sampler=self.batch_sampler, seed=seed, rank=self._topo.rank,
            world_size=self._topo.world_size, even_batches=self.even_batches)
        self._setup = Setup(
            source=self.reader, kind=self._kind, data_path=self.data_path,
            options=self._options, collate_fn=self.collate_fn, num_workers=self.num_workers,
            start_method=self.start_method, prefetch=self._prefetch(), zero_copy=self.zero_copy,
            seed=seed, rank=self._topo.rank, world_size=self._topo.world_size,
            timed=self.timeout is not None, budget=self._budget,
            max_batches=self.max_batches_per_worker, max_rss=self.max_worker_rss,
            loads=self._loads, skips=self._skips, worker_init_fn=self.worker_init_fn,
            worker_type=self.worker_type, worker_nice=self.worker_nice,
            standby=self._box.standby)

    def _prefetch(self) -> int:
        """Batches in flight per worker (its slots): with a load stage, enough index
        batches that ``concurrency`` loads can be in flight across them."""
        if self._loads is None or self._kind is not Kind.MAP:
            return self.prefetch
        size = self.batch_size or 1
        return max(self.prefetch, -(-self._loads.concurrency // size) + 1)

    # ------------------------------------------------------------------ public

    def __aiter__(self) -> AsyncIterator[Any]:
        return Epoch(self, self._device, private=False)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sync())

    def sync(self, device: DeviceLike | None = None) -> SyncLoader:
        """The synchronous face: ``for batch in loader.sync(device="cuda:0")``."""
        target = as_device(device) if device is not None else self._device
        return SyncLoader(self._box.portal, lambda: Epoch(self, target, private=True),
                          self.__len__, target)

    def set_target_device(self, device: DeviceLike | None) -> None:
        """Where batches go from now on (``None``: stay on the CPU)."""
        self._device = as_device(device)

    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch epoch ``epoch`` (its shuffle and worker seeds).

        Setting the epoch that comes next anyway changes nothing (workers stay); another
        one restarts the stream there.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._next_pass:
            self._next_pass = epoch
            self._resume = None  # a resumed position belongs to its own epoch
            self._cursor = Cursor(pass_no=epoch)

    def stats(self) -> LoaderStats:
        """The loader's telemetry so far: batches and bytes handed over, the time the
        consumer waited for them and its share of the run ("data stall"), the workers'
        rates and busy shares, the arena's slots, restarts. Cheap enough for every step.

        Examples:
            >>> loader = DataLoader(list(range(8)), batch_size=4, quiet=True)
            >>> _ = list(loader)
            >>> loader.stats().batches
            2
        """
        session = self._box.session
        workers, arena = session.producer.stats() if session is not None else ((), NO_ARENA)
        meter = self._meter
        wall = meter.wall()
        return LoaderStats(
            batches=meter.batches, bytes=meter.bytes, wait_s=meter.wait, wall_s=wall,
            data_stall=meter.wait / wall if wall > 0 else 0.0,
            time_to_first_batch_s=meter.first, workers=workers, arena=arena,
            restarts=self._budget.restarts, recycles=self._budget.recycles,
            skipped=len(self._skips.skipped))

    @property
    def skipped(self) -> list[SkippedLoad]:
        """The keys whose load failed and was skipped (``on_error="skip"``), in the order
        they were reported, across epochs: key, worker, attempts and the last error."""
        return list(self._skips.skipped)

    @property
    def dataset(self) -> Any:
        """The source, under torch's name (``loader.dataset``): the same as ``reader``."""
        return self.reader

    @property
    def sampler(self) -> Any:
        """The ``sampler=`` given, as torch's ``loader.sampler`` (its ``set_epoch`` is the
        user's, as with torch). Otherwise the loader's own sampling, as torch integrations
        see it: ``sampler.set_epoch(e)``, which PyTorch Lightning calls before each epoch, is
        :meth:`set_epoch`."""
        if self._user_sampler is not None:
            return self._user_sampler
        return EpochSetter(self)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as a small JSON-able dict, for a checkpoint.

        Call it between any two batches or between epochs. A fresh loader built with the same
        arguments, given it with :meth:`load_state_dict`, produces exactly the batches this
        one would have produced next, whatever was prefetched or in flight.

        Examples:
            >>> loader = DataLoader(list(range(10)), batch_size=4, quiet=True)
            >>> first = next(iter(loader))
            >>> again = DataLoader(list(range(10)), batch_size=4, quiet=True)
            >>> again.load_state_dict(loader.state_dict())
            >>> [b.tolist() for b in again]
            [[4, 5, 6, 7], [8, 9]]
        """
        if self._loads is not None and not self._loads.ordered and self._kind is not Kind.MAP:
            raise ResumeError(
                "state_dict() with ordered=False: loads finish out of order, so no position "
                "in the keys says what was delivered. Use ordered=True to checkpoint (loads "
                "still overlap)")
        with self._lock:
            cursor = self._cursor
        cache = self._cache
        return make_state(self._fingerprint(), self._base_seed, cursor,
                          len(cache) if cache is not None and self._cached() else None)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the next batches are those that followed it.

        Raises :class:`~aioloader.ResumeError` (and changes nothing) when ``state`` is not a
        loader's state, or was taken with other arguments; the loader stays usable.
        """
        point = read_state(state, self._fingerprint(), seed=self.seed,
                           shards=self._setup.shards if self._lazy() else None)
        with self._lock:
            current = self._epoch() if self._epoch is not None else None
            if current is not None:
                raise LoaderBusyError(
                    "load_state_dict() while an epoch is being iterated: finish or close "
                    "that epoch first (`loader.close()`), then load the state")
        # Workers that persisted from an earlier epoch are elsewhere; standbys hold nothing
        # of it and stay for the next session.
        self._close_session()
        if point.seed != self._base_seed:
            self._configure(point.seed)
        self._resume = point
        self._next_pass = point.pass_no
        self._cursor = Cursor(point.pass_no, point.in_pass, point.in_epoch,
                              carried=point.in_epoch)
        if point.stream is not None and not is_stateful(self.reader) and self._loads is None:
            skipped = sum(p.start.raw for p in point.stream.shards)
            if skipped:
                warnings.warn(
                    f"resuming {type(self.reader).__name__} by reading and skipping {skipped} "
                    "instances: it has no state_dict()/load_state_dict() of its own. Give it "
                    "those (a position in its files) to resume in constant time",
                    ResumeWarning, stacklevel=2)

    def _keeps_workers(self) -> bool:
        """Whether a completed epoch leaves its workers up for the next one."""
        return self.persistent_workers or self.num_workers == 0

    def _hold_position(self) -> None:
        """A completed epoch is about to stop its workers (``persistent_workers=False``):
        with ``batches_per_epoch`` the stream goes on where it stopped, so the next session
        starts there, as after :meth:`load_state_dict`."""
        if self.batches_per_epoch is None:
            return  # the next epoch starts a pass of its own
        with self._lock:
            cursor = self._cursor
        cache = self._cache
        self._resume = ResumePoint(
            seed=self._base_seed, pass_no=cursor.pass_no, in_pass=cursor.in_pass, in_epoch=0,
            stream=cursor.stream() if cursor.stream is not None else None,
            instances=len(cache) if cache is not None and self._cached() else None)

    def _lazy(self) -> bool:
        return self._kind is not Kind.MAP and self.max_instances_in_memory is not None

    def _cached(self) -> bool:
        return self._kind is not Kind.MAP and self.max_instances_in_memory is None

    def _fingerprint(self) -> dict[str, Any]:
        """The arguments a state depends on, as data (the seed is checked apart)."""
        sampler = self.batch_sampler
        return {
            "source": self._kind.value,
            "cached": self._cached(),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "batch_sampler": None if sampler is None else type(sampler).__qualname__,
            "batches_per_epoch": self.batches_per_epoch,
            "max_instances_in_memory": self.max_instances_in_memory,
            "rank": self._topo.rank,
            "world_size": self._topo.world_size,
            "even_batches": self.even_batches,
            # A stream is read in one shard per worker; index batches are the same whatever
            # the number of workers.
            "shards": self._setup.shards if self._lazy() else None,
            "dataset_len": len(self.reader) if self._kind is Kind.MAP else None,
        }

    def __len__(self) -> int:
        if self.batches_per_epoch is not None:
            return self.batches_per_epoch
        if self._kind is Kind.MAP:
            return count_batches(self._plan_spec, self.reader, shared=True)
        if self.max_instances_in_memory is not None:
            raise TypeError(
                "a lazy loader (max_instances_in_memory set) does not know its length: pass "
                "batches_per_epoch, or leave max_instances_in_memory=None to cache the data")
        cache = self._cache
        if cache is None:
            cache = self._box.portal.call(self._ensure_cache())
        return count_batches(self._plan_spec, cache, shared=False)

    async def iter_instances(self) -> AsyncIterator[Any]:
        """The instances of one pass, unbatched (cached mode fills its cache on the way)."""
        if self._kind is Kind.MAP:
            for i in range(len(self.reader)):
                yield self.reader[i]
            return
        if self._cache is not None:
            for item in self._cache:
                yield item
            return
        keep = self.max_instances_in_memory is None
        items: list[Any] = []
        async for chunk in self._read_pass():
            if keep:
                items.extend(chunk)
            for item in chunk:
                yield item
        if keep:
            self._cache = CachedInstances(items)

    async def aclose(self) -> None:
        """Stop the workers; the loader can be iterated again afterwards.

        A consumer waiting for a batch in another task or thread gets
        :class:`~aioloader.LoaderClosedError`.
        """
        if self._box.standby is not None:
            await asyncio.to_thread(self._box.standby.close)
        session = self._take_session()
        if session is None:
            return
        loop = session.loop
        if loop is None or loop is running_loop():
            await session.aclose()
        elif loop is self._box.portal.loop:  # the sync adapter's, driven in bursts
            await asyncio.to_thread(self._box.portal.call, session.aclose())
        elif loop.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(session.aclose(), loop))
        else:
            session.close()

    def close(self) -> None:
        """Blocking :meth:`aclose`, from any thread; also ends the sync adapter's loops."""
        if self._box.standby is not None:
            self._box.standby.close()
        self._close_session()

    def _close_session(self) -> None:
        session = self._take_session()
        if session is not None:
            loop, here = session.loop, running_loop()
            if loop is None and here is None:  # between epochs: an async reader's pass
                self._box.portal.call(session.aclose())  # closes on a loop
            elif loop is None or loop is here:
                session.close()  # from async code on its own loop: blocks it while reaping
            elif loop is self._box.portal.loop:  # the sync adapter's, driven in bursts
                self._box.portal.call(session.aclose())
            elif loop.is_running():  # a user's loop, or the portal's own thread
                asyncio.run_coroutine_threadsafe(session.aclose(), loop).result()
            else:
                session.close()
        self._box.portal.close()

    def _take_session(self) -> Session | None:
        with self._lock:
            session, self._box.session = self._box.session, None
            self._epoch = None
        return session

    async def __aenter__(self) -> DataLoader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions

    async def _session(self) -> Session:
        """The session for the next epoch, started; a new one when the pass moved."""
        session = self._box.session
        if session is not None and (session.closed or self._session_pass != self._next_pass):
            await self._drop_session(session)
            session = None
        if session is None:
            resume, self._resume = self._resume, None
            if resume is not None and resume.pass_no != self._next_pass:
                resume = None
            producer = await self._producer(self._next_pass, resume)
            session = Session(producer)
            self._box.session = session
            self._session_pass = self._next_pass
            with self._lock:
                carried = self._cursor.carried if resume is not None else None
                self._cursor = Cursor(self._next_pass, resume.in_pass if resume else 0,
                                      stream=getattr(producer, "position", None),
                                      carried=carried)
            await session.start()
        return session

    async def _drop_session(self, session: Session, grace: float = GRACE) -> None:
        with self._lock:
            if self._box.session is session:
                self._box.session = None
        await session.aclose(grace)

    async def _producer(self, first_pass: int, resume: ResumePoint | None) -> Producer:
        if self._lazy():
            start = StreamPosition.begin(first_pass, self._setup.shards)
            if resume is not None and resume.stream is not None:
                start = resume.stream
            return self._setup.stream(start, _stream_seeds(self._plan_spec))
        if self._kind is Kind.MAP:
            data: Any = self.reader
            plan = self._map_plan()
        else:
            data = await self._ensure_cache()
            plan = self._cached_plan(data)
            if resume is not None and resume.instances not in (None, len(data)):
                raise ResumeError(
                    f"the state was taken over {resume.instances} instances, but the reader "
                    f"now gives {len(data)}: the data changed, so the position in the epoch "
                    "means other batches")
        ahead = sharding(self._plan_spec, shared=True) is not Sharding.AS_IS
        return self._setup.index(data, plan, first_pass, plan_ahead=ahead,
                                 skip=resume.in_pass if resume is not None else 0)

    def _map_plan(self) -> Plan:
        spec, data = self._plan_spec, self.reader
        return lambda pass_no: plan_epoch(spec, data, pass_no, shared=True)

    def _cached_plan(self, data: CachedInstances) -> Plan:
        spec, topo = self._plan_spec, self._topo
        if not (topo.distributed and self.even_batches):
            return lambda pass_no: plan_epoch(spec, data, pass_no, shared=False)

        target: list[int] = []  # agreed once per cache, by the first plan of the session

        def agreed(pass_no: int) -> Sequence[list[int]]:  # in a thread, never from len()
            if not target:
                target.append(all_reduce(topo, count_batches(spec, data, shared=False), "max"))
            return plan_epoch(spec, data, pass_no, shared=False, target_batches=target[0])

        return agreed

    # ------------------------------------------------------------------ reading

    async def _ensure_cache(self) -> CachedInstances:
        if self._cache is None:
            items: list[Any] = []
            with progress_bar(self.quiet, desc="loading instances", unit="instance") as bar:
                async for chunk in self._read_pass():
                    items.extend(chunk)
                    bar.update(len(chunk))
            self._cache = CachedInstances(items)
        return self._cache

    async def _read_pass(self) -> AsyncIterator[list[Any]]:
        """One pass of instances, in chunks: in this process, or through workers (sharded)."""
        session = Session(self._setup.instances(self._next_pass))
        with self._lock:  # a close() while the cache fills must reach this session
            held = self._box.session is None
            if held:
                self._box.session = session
        try:
            await session.start()
            session.attach()
            while True:
                step = await session.next(self.timeout)
                if isinstance(step, PassDone):
                    return
                yield step.value
        finally:
            with self._lock:
                if held and self._box.session is session:
                    self._box.session = None
            await session.aclose()


class EpochSetter:
    """``loader.sampler``: only ``set_epoch(epoch)``, passed on to the loader.

    Lightning (and other loops written for torch's DataLoader) call
    ``dataloader.sampler.set_epoch(epoch)`` before each epoch; this keeps the loader's epoch
    in step with theirs, which matters when they resume from a checkpoint.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._loader = weakref.ref(loader)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


def _stats_to_stderr() -> None:
    """``log_every`` asks for the lines: make sure they show even where logging is not set
    up (Python shows warnings only by default). Configure ``aioloader.stats`` to route them."""
    log = logging.getLogger("aioloader.stats")
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():  # nothing up the tree would print it
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)


def _stream_seeds(spec: PlanSpec) -> Callable[[int], int]:
    """A stream's seed per pass in this process: worker 0's, so that one shard gives the
    same batches in or out of a worker. Not a method: a producer holding the loader would
    keep it (and its workers) alive after the user dropped it."""
    return lambda pass_no: worker_seed(spec, pass_no, 0)


def _pinning_available(device: str) -> bool:
    """torch's rule for ``pin_memory=True``: without an accelerator it warns and pins
    nothing (the batches are still good); ``pin_memory_device`` is deprecated there and
    ignored with a warning, here too."""
    if device:
        warnings.warn(f"pin_memory_device is deprecated in torch, and ignored here: batches "
                      f"are pinned for the current accelerator (not {device!r})",
                      stacklevel=3)
    if can_pin():
        return True
    warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then "
                  "device pinned memory won't be used.", stacklevel=3)
    return False
