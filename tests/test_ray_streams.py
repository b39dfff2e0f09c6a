"""worker_type="ray" and an IterableDataset: torch's contract (issue 32), as worker processes
keep it (tests/test_torch_suite_gaps.py), each checked against torch's DataLoader on the
same data in the same test, on tests/test_ray.py's cluster.

- an exception of a worker's iterator (or of the collate) is that batch's: ``next()``
  raises it and the epoch goes on (before: the epoch ended at the error);
- persistent workers left early by ``break`` start the stream again in the same actors:
  ``worker_init_fn`` runs once per worker (before: the actors were restarted, and it ran
  again each epoch);
- and a map-style dataset's error, which ended a Ray epoch too: that batch's, and the next
  batches follow, as with worker processes and torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import test_torch_suite_gaps  # noqa: E402
import torch.utils.data as tud  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray_sources import Items  # noqa: E402
from test_ray import (  # noqa: E402
    assert_clean,
    cluster,  # noqa: F401 - the module's simulated 3-node cluster (a fixture)
)
from test_torch_suite_gaps import (  # noqa: E402
    _broken_epochs_of_both,
    _failing_at_102,
    _Flaky,
    _outcomes,
)

import aioloader  # noqa: E402

pytestmark = [pytest.mark.leaks_ok, pytest.mark.deadline(120)]

# torch's workers come from a forkserver: forked from this process, a Ray driver, they
# carry copies of its connections to Ray (after a few such loaders, this driver's next
# call to Ray's GCS, an actor class's export, hung here).
TORCH: dict[str, Any] = {"multiprocessing_context": "forkserver"}


@pytest.fixture(scope="module")
def by_value(cluster: Cluster) -> Iterator[Cluster]:  # noqa: F811
    """The sources (test_torch_suite_gaps') travel to the actors by value."""
    sources = sys.modules[test_torch_suite_gaps.__name__]
    cloudpickle.register_pickle_by_value(sources)
    try:
        yield cluster
    finally:
        cloudpickle.unregister_pickle_by_value(sources)


def _on_ray(**options: Any) -> list[Any]:
    loader = aioloader.DataLoader(_Flaky(options.pop("generator", False)), batch_size=2,
                                  num_workers=2, worker_type="ray", quiet=True, **options)
    try:
        return _outcomes(iter(loader).__next__)
    finally:
        loader.close()


@pytest.mark.parametrize("generator", [False, True])
def test_a_ray_streams_error_is_one_batchs_and_its_epoch_goes_on_as_torchs(
        by_value: Cluster, generator: bool) -> None:
    # worker 0's iterator raises at its pulls 1 (mid-batch) and 4: torch sends each error
    # in that batch's place and goes on (a generator that raised is over); on Ray the epoch
    # ended at the first error
    theirs = _outcomes(iter(tud.DataLoader(_Flaky(generator), batch_size=2, num_workers=2,
                                           **TORCH)).__next__)
    assert _on_ray(generator=generator) == theirs
    assert theirs == (["ValueError", [100, 101], [102, 103], [104, 105], [106]] if generator
                      else ["ValueError", [100, 101], [1, 2], [102, 103], "ValueError",
                            [104, 105], [3, 4], [106], [5, 6]])
    assert_clean([])


def test_a_ray_streams_collate_error_is_one_batchs_as_torchs(by_value: Cluster) -> None:
    theirs = _outcomes(iter(tud.DataLoader(_Flaky(), batch_size=2, num_workers=2,
                                           collate_fn=_failing_at_102, **TORCH)).__next__)
    assert _on_ray(collate_fn=_failing_at_102) == theirs
    assert theirs.count("ValueError") == 3
    assert_clean([])


def test_persistent_ray_workers_start_a_stream_again_after_an_epoch_left_early_as_torchs(
        by_value: Cluster, tmp_path: Any) -> None:
    # torch keeps its processes (worker_init_fn once per worker), each calls iter(dataset)
    # again and the abandoned epoch's batches are dropped; on Ray the actors were restarted
    # after each break, worker_init_fn and all. The actors run on this machine: they log
    # their worker_init_fn calls to the same file.
    theirs, ours = _broken_epochs_of_both(tmp_path, TORCH,
                                          {"worker_type": "ray", "quiet": True})
    assert ours == theirs
    assert theirs[2] == 2
    assert_clean([])


def test_a_ray_map_style_error_is_one_batchs_and_its_epoch_goes_on_as_torchs(
        by_value: Cluster) -> None:
    def outcomes(loader: Any) -> list[Any]:
        got: list[Any] = []
        it = iter(loader)
        while True:
            try:
                got.append(next(it)["i"].tolist())
            except StopIteration:
                return got
            except KeyError as err:
                assert "no item 6" in str(err)
                got.append("KeyError")

    theirs = outcomes(tud.DataLoader(Items(16, fail_at=6), batch_size=4, num_workers=2,
                                     **TORCH))
    ours = aioloader.DataLoader(Items(16, fail_at=6), batch_size=4, num_workers=2,
                                worker_type="ray", quiet=True)
    try:
        assert outcomes(ours) == theirs
    finally:
        ours.close()
    assert theirs == [[0, 1, 2, 3], "KeyError", [8, 9, 10, 11], [12, 13, 14, 15]]
    assert_clean([])
