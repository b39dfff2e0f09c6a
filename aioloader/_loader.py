"""DataLoader: its config, its run, and the two faces (``async for`` and the sync adapter)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar, Unpack, overload

import torch

from ._config import LoaderConfig, Option, build_config, fixed
from ._options import LoaderOptions, ReaderOptions
from ._signature import bind, torch_form
from ._stats import LoaderStats, stats_to_stderr
from .pipeline._loads import Retry, SkippedLoad
from .plane._device import DeviceLike, as_device
from .plans._sources import SupportsRead
from .run._backstop import backstop
from .run._epoch import Epoch, EpochSetter
from .run._run import Run
from .run._sync import SyncLoader

T_co = TypeVar("T_co", covariant=True)


class DataLoader(Generic[T_co]):
    """Batches from a reader or dataset, built in worker processes, consumed with ``async for``.

    Two call forms, chosen by the first argument alone:

    - a dataset (a torch ``Dataset`` or ``IterableDataset``, or any object with
      ``__getitem__`` and ``__len__``): torch's ``DataLoader(dataset, batch_size=1,
      shuffle=None, sampler=None, batch_sampler=None, num_workers=0, collate_fn=None,
      pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
      multiprocessing_context=None, generator=None, *, prefetch_factor=None,
      persistent_workers=False, pin_memory_device="", in_order=True, ...)``: its names
      (``dataset=`` too), positional order, defaults and meanings, ``batch_size=None``
      (no automatic batching: each sample through ``default_convert``) included;
    - a reader (an object with ``read(data_path)``): AllenNLP's ``DataLoader(reader,
      data_path=None, *, ...)``, every other argument by name, ``persistent_workers=True``.

    aioloader's own options (below) are keyword-only in both.

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

    ``worker_type="thread"`` runs the workers as threads of this process: batches by
    reference (no shared memory, no copy), no ``start_method``, the process's RNGs shared
    (``get_worker_info().seed`` is still per worker), and no restarts or recycling (threads
    cannot be killed). Several thread workers share the source, but for a streamed one that
    keeps its own position (``state_dict``): each reads its own ``copy.deepcopy``, as a
    worker process reads its pickled or forked copy. With the GIL, processes won or tied on
    throughput in every workload measured (docs/performance.md).

    ``worker_type="ray"`` runs each worker as a Ray actor, placed by Ray's scheduler in the
    caller's Ray context (``ray.init(address=...)``; without one, a local Ray starts):
    same batches, seeds, sharding and order as worker processes, each batch built where
    its actor runs and handed over through Ray's object store (docs/beyond.md).
    ``ray_options`` (a dict) goes to each actor's ``.options()``: ``num_cpus`` (default
    1), ``resources``, ``scheduling_strategy``, ``runtime_env``; ``loader.ray_options``
    is a read-only view of it. Needs
    ``pip install aioloader[ray]``.

    ``worker_nice`` (0 to 19) lowers the worker processes' CPU priority (``os.nice`` in each):
    where they keep every core busy, the consumer gets a core as soon as it wakes. Left unset
    (None), it is 19 when worker processes are as many as the cores this process may run on
    (``os.sched_getaffinity``), and 0 otherwise; ``worker_nice=0`` keeps them at your
    priority whatever their number. Nicer workers also yield to every other process of the
    machine (docs/performance.md). ``loader.worker_nice`` says what was chosen.

    ``fetch_on_loop=True`` (``num_workers=0`` only) runs each fetch of an ``async for``
    on the caller's event loop instead of the loader's thread, as torch's ``num_workers=0``
    runs it on the caller's thread: no thread hop, but the loop stops while a
    ``__getitem__`` runs, and a dataset that waits for that loop (an async client bound to
    it, asked through ``run_coroutine_threadsafe(...).result()``) hangs it for good. By
    default fetches run in the thread, ``prefetch`` batches ahead of the consumer.

    ``quiet=None`` (the default) follows tqdm's convention: a progress bar for each epoch
    (and for reading a reader into its cache) when stderr is a terminal or in a Jupyter
    notebook, nothing when stderr is redirected (logs, CI), as torch prints nothing. It is
    decided as each bar starts. ``quiet=True`` never shows bars; ``quiet=False`` always does.

    The options are read-only attributes (``loader.batch_size``, ``loader.num_workers``,
    ...), fixed when the loader is built; where batches go can change:
    :meth:`set_target_device`.

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

    @overload
    def __init__(self, reader: SupportsRead, data_path: Any = None,
                 **options: Unpack[ReaderOptions]) -> None: ...
    @overload
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], object] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        **options: Unpack[LoaderOptions],
    ) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        source, arguments = bind(args, kwargs)
        self._config = build_config(source, **arguments)
        self._device = self._config.output.device
        if self._config.output.log_every is not None:
            stats_to_stderr()
        self._run = Run(self._config)
        backstop(self, self._run.owned.kill)  # it holds nothing of the loader

    __init__.__signature__ = torch_form()  # type: ignore[attr-defined]  # for help()

    # Options, read-only: the arguments as the loader keeps them (LoaderConfig.arguments).
    reader: Option[Any] = Option()
    data_path: Option[Any] = Option()
    collate_fn: Option[Callable[[list[Any]], Any] | None] = Option()
    batch_size: Option[int | None] = Option()
    drop_last: Option[bool] = Option()
    shuffle: Option[bool] = Option()
    batch_sampler: Option[Any] = Option()
    batches_per_epoch: Option[int | None] = Option()
    max_instances_in_memory: Option[int | None] = Option()
    even_batches: Option[bool] = Option()
    num_workers: Option[int] = Option()
    worker_type: Option[str] = Option()
    start_method: Option[str] = Option()
    worker_nice: Option[int] = Option()
    prefetch: Option[int] = Option()
    fetch_on_loop: Option[bool] = Option()
    zero_copy: Option[bool] = Option()
    max_worker_restarts: Option[int] = Option()
    max_batches_per_worker: Option[int | None] = Option()
    max_worker_rss: Option[int | None] = Option()
    worker_init_fn: Option[Callable[[int], object] | None] = Option()
    persistent_workers: Option[bool] = Option()
    quiet: Option[bool | None] = Option()
    timeout: Option[float | None] = Option()
    log_every: Option[float | None] = Option()
    seed: Option[int | None] = Option()
    load_fn: Option[Callable[[Any], Any] | None] = Option()
    concurrency: Option[int | None] = Option()
    ordered: Option[bool] = Option()
    retries: Option[int | Retry] = Option()
    on_error: Option[str] = Option()
    prefetch_factor: Option[int | None] = Option()
    generator: Option[torch.Generator | None] = Option()
    in_order: Option[bool] = Option()
    multiprocessing_context: Option[Any] = Option()
    pin_memory: Option[bool] = Option()
    pin_memory_device: Option[str] = Option()

    @property
    def ray_options(self) -> Mapping[str, Any] | None:
        """``ray_options`` as given, as a read-only view: the config's own dict is what
        every actor (a replacement's included) is started with, so nobody may change it."""
        options = self._config.workers.ray_options
        return None if options is None else MappingProxyType(options)

    @ray_options.setter
    def ray_options(self, value: Any) -> None:
        raise fixed("ray_options", value)

    @property
    def config(self) -> LoaderConfig:
        """Every option, checked and resolved, as one frozen value."""
        return self._config

    # ------------------------------------------------------------------ the faces

    def __aiter__(self) -> AsyncIterator[Any]:
        return Epoch(self, self._run, self._device, private=False)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sync())

    def sync(self, device: DeviceLike | None = None) -> SyncLoader:
        """The synchronous face: ``for batch in loader.sync(device="cuda:0")``."""
        target = as_device(device) if device is not None else self._device
        return SyncLoader(self._run.owned.portal,
                          lambda: Epoch(self, self._run, target, private=True),
                          self.__len__, target)

    def set_target_device(self, device: DeviceLike | None) -> None:
        """Where the batches of epochs that begin from now on go (``None``: stay on the
        CPU). An epoch in progress keeps the device it began with; ``loader.sync()`` takes
        the loader's device when it is called, ``loader.sync(device)`` keeps its own."""
        self._device = as_device(device)

    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch epoch ``epoch`` (its shuffle and worker seeds).

        Setting the epoch that comes next anyway changes nothing (workers stay); another
        one restarts the stream there.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._run.set_epoch(epoch)

    def __len__(self) -> int:
        return self._run.reading.length()

    async def iter_instances(self) -> AsyncIterator[Any]:
        """The instances of one pass, unbatched (cached mode fills its cache on the way)."""
        async for item in self._run.reading.instances():
            yield item

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
        return self._run.stats()

    @property
    def skipped(self) -> list[SkippedLoad]:
        """The keys whose load failed and was skipped (``on_error="skip"``), in the order
        they were reported, across epochs: key, worker, attempts and the last error."""
        return list(self._run.skips.skipped)

    @property
    def dataset(self) -> Any:
        """The source, under torch's name (``loader.dataset``): the same as ``reader``."""
        return self._config.source

    @dataset.setter
    def dataset(self, value: Any) -> None:
        raise fixed("dataset", value)

    @property
    def sampler(self) -> Any:
        """The ``sampler=`` given, as torch's ``loader.sampler`` (its ``set_epoch`` is the
        user's, as with torch). Otherwise the loader's own sampling, as torch integrations
        see it: ``sampler.set_epoch(e)``, which PyTorch Lightning calls before each epoch, is
        :meth:`set_epoch`."""
        if self._config.batching.sampler is not None:
            return self._config.batching.sampler
        return EpochSetter(self)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        raise fixed("sampler", value)

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
        return self._run.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from a :meth:`state_dict`: the next batches are those that followed it.

        ``state`` is this rank's state, or a list of the states every rank took at one step:
        on another world size (or, for a stream, another number of workers) the rest of the
        epoch is dealt again so that every instance is still seen once (see "Checkpoint and
        resume" in the docs). Raises :class:`~aioloader.ResumeError` (and changes nothing)
        when ``state`` is not a loader's state, or was taken with other arguments; the loader
        stays usable.
        """
        self._run.load_state_dict(state)

    # ------------------------------------------------------------------ lifetime

    async def aclose(self) -> None:
        """Stop the workers; the loader can be iterated again afterwards.

        A consumer waiting for a batch in another task or thread gets
        :class:`~aioloader.LoaderClosedError`.
        """
        await self._run.aclose()

    def close(self) -> None:
        """Blocking :meth:`aclose`, from any thread; also ends the sync adapter's loops."""
        self._run.close()

    async def __aenter__(self) -> DataLoader[T_co]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
