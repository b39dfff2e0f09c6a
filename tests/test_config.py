"""LoaderConfig: the arguments checked once, torch's aliases resolved, options read-only."""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing

import pytest
import torch

import aioloader
from aioloader._config import LoaderConfig, build_config

PARAMETERS = [name for name in inspect.signature(aioloader.DataLoader).parameters
              if name != "cuda_device"]  # where batches go: set_target_device()


class Slow(torch.utils.data.Dataset[int]):
    """A dataset whose items take ``delay`` seconds each to build, in the worker."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        import time

        time.sleep(self.delay)  # the work itself, not a synchronisation
        return i


def test_every_option_is_a_read_only_attribute() -> None:
    loader = aioloader.DataLoader(list(range(4)), batch_size=2, quiet=True)
    for name in PARAMETERS:
        getattr(loader, name)  # readable
        with pytest.raises(AttributeError, match=f"DataLoader.{name} is fixed"):
            setattr(loader, name, getattr(loader, name))


def test_a_timeout_set_afterwards_is_refused_not_half_applied() -> None:
    # issue 20: `loader.timeout = 5` on a loader built without one armed the consumer's
    # timer while the workers (set up without one) sent no progress: a slow reader, each
    # item under the timeout but its batch over it, timed out falsely.
    loader = aioloader.DataLoader(Slow(4, 0.3), batch_size=4, num_workers=1, quiet=True)
    with pytest.raises(AttributeError, match=r"build a new DataLoader\(\.\.\., timeout=0\.5\)"):
        loader.timeout = 0.5
    assert loader.timeout is None
    # Built with it, the workers report progress: each 0.3 s item keeps the 0.5 s timer
    # quiet, although the batch takes 1.2 s.
    with aioloader.DataLoader(Slow(4, 0.3), batch_size=4, num_workers=1, timeout=0.5,
                              quiet=True) as timed:
        assert timed.config.workers.progress
        assert [b.tolist() for b in timed] == [[0, 1, 2, 3]]
    loader.close()


def test_torch_aliases_are_resolved_in_the_config() -> None:
    generator = torch.Generator().manual_seed(7)
    config = build_config(
        list(range(10)), batch_size=2, drop_last=False, shuffle=False,
        batch_sampler=None, batches_per_epoch=None, num_workers=2,
        max_instances_in_memory=None, start_method="fork", worker_type="process",
        worker_nice=0, cuda_device=None, quiet=True, collate_fn=None, seed=None, timeout=0,
        prefetch=None, even_batches=True, zero_copy=True, max_worker_restarts=0,
        max_batches_per_worker=None, max_worker_rss=None, log_every=None, load_fn=None,
        concurrency=None, ordered=True, retries=0, on_error="raise",
        sampler=torch.utils.data.SequentialSampler(range(10)), worker_init_fn=None,
        persistent_workers=True, prefetch_factor=3, generator=generator, in_order=True,
        multiprocessing_context=multiprocessing.get_context("spawn"), pin_memory=False,
        pin_memory_device="")
    assert isinstance(config, LoaderConfig)
    assert config.workers.start_method == "spawn"  # multiprocessing_context
    assert config.arguments["prefetch"] == config.workers.slots == 3  # prefetch_factor
    assert config.output.timeout is None  # timeout=0
    # sampler=: torch's BatchSampler over it, with batch_size and drop_last
    sampler = config.batching.batch_sampler
    assert isinstance(sampler, torch.utils.data.BatchSampler)
    assert (sampler.batch_size, sampler.drop_last) == (2, False)
    # The base seed is drawn from the generator when the first epoch starts (Run.seed).
    assert config.seed is None and config.arguments["generator"] is generator
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]


def test_the_load_stage_widens_the_slots_of_index_batches() -> None:
    async def load(key: int) -> int:
        return key

    loader = aioloader.DataLoader(list(range(64)), batch_size=4, load_fn=load,
                                  concurrency=32, num_workers=1, quiet=True)
    workers = loader.config.workers
    assert loader.prefetch == 4
    assert workers.slots == 9  # 32 loads over batches of 4, and one more being filled
    loader.close()
