"""DataLoader: options, validation, epochs, async iteration."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._device import DeviceLike, as_device, move_to
from ._distributed import Topology, all_reduce, even_out, shard_indices, topology
from ._errors import LoaderBusyError, LoaderTimeoutError
from ._pipeline import BatchOptions
from ._portal import Portal, run_blocking
from ._samplers import BatchSampler, derive_seed, num_batches, plan_indices
from ._sessions import (
    CachedInstances,
    Delivered,
    LocalIndex,
    LocalStream,
    PassDone,
    Session,
    WorkerIndex,
    WorkerInstances,
    WorkerStream,
    local_instances,
)
from ._sources import Kind, classify
from ._supervisor import GRACE, Supervisor
from ._worker import Plan, WorkerSpec

if TYPE_CHECKING:
    from ._sync import SyncLoader

START_METHODS = ("fork", "spawn", "forkserver")


class _Box:
    """What the garbage collector's backstop (weakref.finalize) must stop: the live session
    and the sync adapter's loops."""

    session: Session | None = None
    portal: Portal | None = None

    def kill(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.kill()
        portal, self.portal = self.portal, None
        if portal is not None:
            portal.close()


@dataclass(frozen=True)
class _Planner:
    """Which instances form each batch of a pass, decided in the main process.

    Kept apart from the loader so that the sessions holding it do not keep the loader alive
    (the garbage collector's backstop must be able to run).
    """

    batch_size: int | None
    drop_last: bool
    shuffle: bool
    sampler: Any
    base_seed: int
    topo: Topology
    even_batches: bool

    def passes(self, data: Sequence[Any], first_pass: int,
               shared: bool) -> Iterator[list[list[int]]]:
        for pass_no in itertools.count(first_pass):
            yield self.plan(data, pass_no, shared)

    def plan(self, data: Sequence[Any], pass_no: int, shared: bool) -> list[list[int]]:
        """The index batches of pass ``pass_no`` for this rank.

        ``shared``: every rank holds the same ``data`` (a map-style dataset), so the ranks
        split one plan; otherwise ``data`` is this rank's own shard (a cached reader).
        """
        sampler, topo = self.sampler, self.topo
        rng = random.Random(derive_seed(self.base_seed, pass_no))
        if sampler is None and shared and topo.distributed:
            assert self.batch_size is not None
            order = list(range(len(data)))
            if self.shuffle:
                rng.shuffle(order)
            mine = shard_indices(len(data), topo.rank, topo.world_size,
                                 even=self.even_batches, drop_last=self.drop_last, order=order)
            batches = [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            if self.drop_last and batches and len(batches[-1]) < self.batch_size:
                batches.pop()
            return batches
        if sampler is not None and not isinstance(sampler, BatchSampler):
            batches = [[int(i) for i in batch] for batch in sampler]
        else:
            source: Any = data if sampler is not None else len(data)
            batches = plan_indices(source, batch_size=self.batch_size,
                                   drop_last=self.drop_last, shuffle=self.shuffle,
                                   sampler=sampler, rng=rng)
        if topo.distributed and shared:
            total = len(batches)
            batches = batches[topo.rank::topo.world_size]
            if self.even_batches:
                batches = even_out(batches, -(-total // topo.world_size))
        elif topo.distributed and self.even_batches:
            batches = even_out(batches, all_reduce(topo, len(batches), "max"))
        return batches

    def num_batches(self, data: Sequence[Any], shared: bool) -> int:
        sampler = self.sampler
        if self.topo.distributed:
            return len(self.plan(data, 0, shared))
        if sampler is None:
            assert self.batch_size is not None
            return num_batches(len(data), self.batch_size, self.drop_last)
        if isinstance(sampler, BatchSampler):
            return sampler.get_num_batches(data)
        return len(sampler)

    def seed_for(self, pass_no: int) -> int:
        return derive_seed(self.base_seed, pass_no, self.topo.rank, 0)


class DataLoader:
    """Batches from a reader or dataset, built in worker processes, consumed with ``async for``.

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
        cuda_device: DeviceLike | None = None,
        quiet: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        prefetch: int = 4,
        even_batches: bool = True,
    ) -> None:
        _validate(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
                  batch_sampler=batch_sampler, batches_per_epoch=batches_per_epoch,
                  num_workers=num_workers, max_instances_in_memory=max_instances_in_memory,
                  start_method=start_method, timeout=timeout, prefetch=prefetch)
        self._kind = classify(reader)
        if self._kind is not Kind.MAP and batch_sampler is not None and not isinstance(
                batch_sampler, BatchSampler):
            raise ValueError(
                f"batch_sampler {type(batch_sampler).__name__} yields indices, which only a "
                "map-style Dataset can use; for a reader pass an aioloader.BatchSampler "
                "(such as aioloader.BucketBatchSampler)")
        self.reader = reader
        self.data_path = data_path
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.batch_sampler = batch_sampler
        self.batches_per_epoch = batches_per_epoch
        self.num_workers = num_workers
        self.max_instances_in_memory = max_instances_in_memory
        self.start_method = start_method
        self.quiet = quiet
        self.collate_fn = collate_fn
        self.seed = seed
        self.timeout = timeout
        self.prefetch = prefetch
        self.even_batches = even_batches
        self._device = as_device(cuda_device)
        self._topo = topology(even_batches)
        if seed is None:
            # Ranks must agree on one shuffle; like DistributedSampler, default to seed 0.
            seed = 0 if self._topo.distributed else random.SystemRandom().getrandbits(63)
        self._base_seed = seed
        self._options = BatchOptions(
            batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
            sampler=batch_sampler if isinstance(batch_sampler, BatchSampler) else None,
            chunk_size=max_instances_in_memory)
        self._planner = _Planner(batch_size, drop_last, shuffle, batch_sampler,
                                 self._base_seed, self._topo, even_batches)
        self._cache: CachedInstances | None = None
        self._next_pass = 0  # the pass a new session starts with
        self._restart = False  # set_epoch(): the next epoch starts a new session
        self._box = _Box()
        self._epoch: object | None = None  # token of the epoch in progress
        self._running = False  # an epoch is inside session.next() right now
        self._finalizer = weakref.finalize(self, _Box.kill, self._box)

    # ------------------------------------------------------------------ public

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate(self._device)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sync())

    def sync(self, device: DeviceLike | None = None) -> SyncLoader:
        """The synchronous face: ``for batch in loader.sync(device="cuda:0")``."""
        from ._sync import SyncLoader

        target = as_device(device) if device is not None else self._device
        return SyncLoader(self, target)

    def set_target_device(self, device: DeviceLike | None) -> None:
        """Where batches go from now on (``None``: stay on the CPU)."""
        self._device = as_device(device)

    def set_epoch(self, epoch: int) -> None:
        """Start the next epoch as epoch ``epoch`` (its shuffle and worker seeds)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._next_pass = epoch
        self._restart = True

    def __len__(self) -> int:
        if self.batches_per_epoch is not None:
            return self.batches_per_epoch
        if self._kind is Kind.MAP:
            return self._planner.num_batches(self.reader, shared=True)
        if self.max_instances_in_memory is not None:
            raise TypeError(
                "a lazy loader (max_instances_in_memory set) does not know its length: pass "
                "batches_per_epoch, or leave max_instances_in_memory=None to cache the data")
        if self._cache is None:
            run_blocking(self._portal(), self._ensure_cache)
        assert self._cache is not None
        return self._planner.num_batches(self._cache, shared=False)

    async def iter_instances(self) -> AsyncGenerator[Any, None]:
        """The instances of one pass, unbatched (cached mode fills its cache on the way)."""
        if self._kind is Kind.MAP:
            for i in range(len(self.reader)):
                yield self.reader[i]
            return
        if self._cache is not None:
            for item in self._cache:
                yield item
            return
        items: list[Any] = []
        async for item in self._read_pass():
            if self.max_instances_in_memory is None:
                items.append(item)
            yield item
        if self.max_instances_in_memory is None:
            self._cache = CachedInstances(items)

    async def aclose(self) -> None:
        """Stop the workers; the loader can be iterated again afterwards."""
        self._epoch = None
        session, self._box.session = self._box.session, None
        if session is not None:
            await session.aclose()
        portal, self._box.portal = self._box.portal, None
        if portal is not None:
            portal.close()

    def close(self) -> None:
        """Blocking version of :meth:`aclose`; also ends the sync adapter's event loops."""
        self._epoch = None
        session, self._box.session = self._box.session, None
        portal, self._box.portal = self._box.portal, None
        if session is not None:
            if portal is not None and portal.usable_here():
                portal.call(session.aclose())  # an async reader's pass closes on its loop
            else:
                session.close()
        if portal is not None:
            portal.close()

    def _portal(self) -> Portal:
        """The sync adapter's loops, kept for the loader's lifetime (see Portal)."""
        if self._box.portal is None:
            self._box.portal = Portal()
        return self._box.portal

    async def __aenter__(self) -> DataLoader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ epochs

    async def _iterate(self, device: torch.device | None) -> AsyncGenerator[Any, None]:
        if self._running:
            raise LoaderBusyError(
                "this loader is already being iterated: finish or close that epoch first, "
                "or make a second DataLoader")
        token = object()
        for _ in range(3):  # a loop of `async for` left by `break`: its finalizer is queued
            if self._epoch is None:
                break
            await asyncio.sleep(0)
        if self._epoch is not None:
            raise LoaderBusyError(
                "this loader is already being iterated (an epoch is in progress): finish or "
                "close that epoch first (`await loader.aclose()`), or make a second DataLoader")
        self._epoch = token
        bar = self._bar()
        finished = False
        failed = False
        try:
            session = await self._session()
            session.attach()
            try:
                produced = 0
                while self.batches_per_epoch is None or produced < self.batches_per_epoch:
                    step = await self._step(session)
                    if self._agree_each_batch() and not await self._all_have(step):
                        await self._skip_rest_of_pass(session, step)
                        self._next_pass += 1
                        break
                    if isinstance(step, PassDone):
                        self._next_pass += 1
                        if self.batches_per_epoch is None or step.empty:
                            break
                        continue
                    produced += 1
                    bar.update(1)
                    # Batches that were already waiting would otherwise come back to back
                    # without the loop running anything else in between.
                    await asyncio.sleep(0)
                    batch = step.value if device is None else move_to(step.value, device)
                    yield batch
                    if self._epoch is not token:
                        raise LoaderBusyError("this epoch was stopped by loader.aclose()/close()")
                finished = True
            except Exception:
                failed = True
                raise
            finally:
                if self._epoch is token:
                    session.detach()
        finally:
            bar.close()
            if self._epoch is token:
                self._epoch = None
                if not finished:  # break, cancellation, an error: this epoch's workers go
                    # After an error nobody waits for the workers' last words: no grace.
                    await self._drop_session(grace=0.0 if failed else GRACE)

    async def _step(self, session: Session) -> Delivered | PassDone:
        self._running = True
        try:
            if self.timeout is None:
                return await session.next()
            try:
                return await asyncio.wait_for(session.next(), self.timeout)
            except TimeoutError as exc:
                raise LoaderTimeoutError(
                    f"no batch within timeout={self.timeout}s; still waiting for "
                    f"{session.behind()}. Raise timeout= if the reader is just slow.") from exc
        finally:
            self._running = False

    def _agree_each_batch(self) -> bool:
        """Streams have no length: with even_batches, ranks agree batch by batch."""
        return (self._topo.distributed and self.even_batches and self.batches_per_epoch is None
                and self._kind is not Kind.MAP and self.max_instances_in_memory is not None)

    async def _all_have(self, step: Delivered | PassDone) -> bool:
        have = 1 if isinstance(step, Delivered) else 0
        loop = asyncio.get_running_loop()
        return bool(await loop.run_in_executor(None, all_reduce, self._topo, have, "min"))

    async def _skip_rest_of_pass(self, session: Session, step: Delivered | PassDone) -> None:
        while not isinstance(step, PassDone):
            step = await self._step(session)

    def _bar(self) -> Any:
        from tqdm.auto import tqdm

        total = self.batches_per_epoch
        if total is None and (self._kind is Kind.MAP or self._cache is not None):
            total = len(self)
        return tqdm(total=total, disable=self.quiet, desc="batches", unit="batch",
                    dynamic_ncols=True)

    async def _drop_session(self, grace: float = GRACE) -> None:
        session, self._box.session = self._box.session, None
        if session is not None:
            await session.aclose(grace)

    async def _session(self) -> Session:
        if self._restart:
            self._restart = False
            await self._drop_session()
        if self._box.session is None:
            self._box.session = await self._open_session(self._next_pass)
        return self._box.session

    async def _open_session(self, first_pass: int) -> Session:
        data: Any
        if self._kind is Kind.MAP:
            data = self.reader
        elif self.max_instances_in_memory is None:
            data = await self._ensure_cache()
        else:
            if self.num_workers == 0:
                return LocalStream(self.reader, self._kind, self.data_path, self._options,
                                   self.collate_fn, self._planner.seed_for, first_pass,
                                   self._topo.rank, self._topo.world_size)
            sup = Supervisor(self._spec("stream", self.reader, self._kind, first_pass),
                             self.num_workers, self.start_method)
            await sup.start()
            return WorkerStream(sup)
        passes = self._planner.passes(data, first_pass, shared=self._kind is Kind.MAP)
        if self.num_workers == 0:
            return LocalIndex(data, passes, self.collate_fn)
        sup = Supervisor(self._spec("index", data, Kind.MAP, first_pass),
                         self.num_workers, self.start_method)
        await sup.start()
        return WorkerIndex(sup, passes, self.prefetch)

    def _spec(self, plan: Plan, source: Any, kind: Kind, first_pass: int) -> WorkerSpec:
        rank, world_size = self._topo.rank, self._topo.world_size
        return WorkerSpec(
            source=source, kind=kind, data_path=self.data_path, plan=plan,
            options=self._options, collate_fn=self.collate_fn, worker_id=0,
            num_workers=self.num_workers, rank=rank, world_size=world_size,
            seed=self._base_seed, first_pass=first_pass, slots=self.prefetch,
            parent_pid=os.getpid() if self.start_method != "forkserver" else 0)

    # ------------------------------------------------------------------ reading

    async def _ensure_cache(self) -> CachedInstances:
        if self._cache is None:
            from tqdm.auto import tqdm

            items: list[Any] = []
            with tqdm(disable=self.quiet, desc="loading instances", unit="instance") as bar:
                async for item in self._read_pass():
                    items.append(item)
                    bar.update(1)
            self._cache = CachedInstances(items)
        return self._cache

    async def _read_pass(self) -> AsyncGenerator[Any, None]:
        """One pass of instances: in this process, or through workers (sharded)."""
        if self.num_workers == 0:
            stream = local_instances(self.reader, self._kind, self.data_path, self._topo.rank,
                                     self._topo.world_size)
            try:
                while True:
                    try:
                        item = await self._within_timeout(stream.__anext__(),
                                                      lambda: "the reader in this process")
                    except StopAsyncIteration:
                        return
                    yield item
            finally:
                await stream.aclose()
        sup = Supervisor(self._spec("instances", self.reader, self._kind, self._next_pass),
                         self.num_workers, self.start_method)
        try:
            await sup.start()
            sup.attach()
            it = WorkerInstances(sup)
            while True:
                try:
                    item = await self._within_timeout(it.__anext__(), it.behind)
                except StopAsyncIteration:
                    return
                yield item
        finally:
            await sup.aclose()

    async def _within_timeout(self, awaitable: Any, behind: Callable[[], str]) -> Any:
        if self.timeout is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except TimeoutError as exc:
            raise LoaderTimeoutError(
                f"no instance within timeout={self.timeout}s; still waiting for {behind()}. "
                "Raise timeout= if the reader is just slow.") from exc


def _validate(*, batch_size: int | None, drop_last: bool, shuffle: bool, batch_sampler: Any,
              batches_per_epoch: int | None, num_workers: int,
              max_instances_in_memory: int | None, start_method: str, timeout: float | None,
              prefetch: int) -> None:
    """The constructor's rules (AllenNLP's MultiProcessDataLoader's, plus a few)."""
    if num_workers is None or num_workers < 0:
        raise ValueError(f"num_workers cannot be negative, got {num_workers}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if batch_sampler is not None:
        for name, value, unset in (("batch_size", batch_size, None), ("drop_last", drop_last,
                                   False), ("shuffle", shuffle, False)):
            if value != unset:
                raise ValueError(f"batch_sampler is mutually exclusive with {name}: the "
                                 "sampler decides how instances are batched")
    elif batch_size is None:
        raise ValueError("batch_size is required when batch_sampler is not given")
    if batches_per_epoch is not None and batches_per_epoch < 1:
        raise ValueError(f"batches_per_epoch must be at least 1, got {batches_per_epoch}")
    if max_instances_in_memory is not None:
        if max_instances_in_memory < 1:
            raise ValueError(
                f"max_instances_in_memory must be at least 1, got {max_instances_in_memory}")
        if batch_size is not None and max_instances_in_memory < batch_size:
            raise ValueError(f"max_instances_in_memory ({max_instances_in_memory}) must be at "
                             f"least batch_size ({batch_size})")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}; "
                         f"got {start_method!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1, got {prefetch}")

