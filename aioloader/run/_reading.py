"""A pass of instances outside any epoch: ``iter_instances()`` and a cached reader's cache.

Cached mode reads a reader's whole pass once, in this process or through workers, and keeps
it; every later epoch plans index batches over it. The run supplies the read (a session it
holds, so that a close reaches it); this module keeps what was read.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

from .._config import LoaderConfig
from ..plans._samplers import num_batches
from ..plans._sources import Kind
from ..workers._producers import CachedInstances
from ..workers._steps import PassDone
from ._bars import progress_bar
from ._owned import Owned
from ._session import Session
from ._setup import Setup


class Reading:
    """The instances of a pass, the cache they fill once (cached mode), and ``len()``.
    ``setup`` and ``next_pass`` are the run's, asked when needed (a loaded state changes
    both); a pass is read in a session that ``owned`` holds while no epoch's does."""

    def __init__(self, config: LoaderConfig, owned: Owned, setup: Callable[[], Setup],
                 next_pass: Callable[[], int]) -> None:
        self._config = config
        self._owned = owned
        self._setup = setup
        self._next_pass = next_pass
        self.cache: CachedInstances | None = None
        self.told: int | None = None  # an IterableDataset's len(loader), once asked

    def length(self) -> int:
        """len(loader): batches per epoch (a cached reader is read for it, once)."""
        c = self._config
        if c.batching.batches_per_epoch is not None:
            return c.batching.batches_per_epoch
        if c.kind is Kind.MAP:
            return self._setup().count(c.source)
        if c.kind is Kind.ITERABLE and c.lazy and c.arguments["max_instances_in_memory"] is None:
            # torch keeps the dataset's own len() and warns when more batches than that
            # have come: its comparison, kept as it is.
            # In batches (a TypeError where it has none), as if one process read it all.
            self.told = n = len(c.source)
            b = c.batching
            return n if b.batch_size is None else num_batches(n, b.batch_size, b.drop_last)
        if c.lazy:
            raise TypeError(
                "a lazy loader (max_instances_in_memory set) does not know its length: pass "
                "batches_per_epoch, or leave max_instances_in_memory=None to cache the data")
        cache = self.cache
        if cache is None:
            cache = self._owned.portal.call(self.ensure_cache())
        return self._setup().count(cache)

    def check_told(self, produced: int) -> None:
        """torch's warning: an IterableDataset gave more batches than ``len(loader)`` said."""
        if self.told is None or produced <= self.told:
            return
        warn = (f"Length of IterableDataset {self._config.source} was reported to be "
                f"{self.told} (when accessing len(dataloader)), but {produced} samples "
                "have been fetched. ")
        if self._config.workers.num_workers > 0:
            warn += ("For multiprocessing data-loading, this could be caused by not properly "
                     "configuring the IterableDataset replica at each worker: each worker must "
                     "read its own part (torch.utils.data.get_worker_info()).")
        warnings.warn(warn, stacklevel=5)

    def known_length(self) -> int | None:
        """The epoch's length where it is known without reading anything."""
        c = self._config
        if c.kind is Kind.MAP and c.batching.batches_per_epoch is None:
            try:
                return self.length()
            except TypeError:  # a sampler without len(): torch iterates it all the same
                return None
        if c.batching.batches_per_epoch is not None or self.cache is not None:
            return self.length()
        return None

    async def instances(self) -> AsyncIterator[Any]:
        """The instances of one pass, unbatched (cached mode fills its cache on the way)."""
        c = self._config
        if c.kind is Kind.MAP:
            for i in range(len(c.source)):
                yield c.source[i]
            return
        if self.cache is not None:
            for item in self.cache:
                yield item
            return
        async for chunk in self._read_pass():
            for item in chunk:
                yield item

    async def ensure_cache(self) -> CachedInstances:
        """The cache, read first if it was not (with a progress bar)."""
        if self.cache is None:
            with progress_bar(self._config.output.quiet, desc="loading instances",
                              unit="instance") as bar:
                async for chunk in self._read_pass():
                    bar.update(len(chunk))
        assert self.cache is not None
        return self.cache

    async def _read_pass(self) -> AsyncIterator[list[Any]]:
        """One pass of instances, in chunks: in this process, or through workers (sharded);
        in cached mode, kept as the cache once the pass is read to its end."""
        session = Session(self._setup().instances(self._next_pass()))
        self._owned.hold(session)  # a close() while the cache fills must reach it
        items: list[Any] = []
        try:
            await session.start()
            session.attach()
            while True:
                step = await session.next(self._config.output.timeout)
                if isinstance(step, PassDone):
                    break
                if self._config.cached:
                    items.extend(step.value)
                yield step.value
        finally:
            await self._owned.drop(session)  # (no longer the run's, if it was)
        if self._config.cached:
            self.cache = CachedInstances(items)
