"""Batch values as users' code sees them, compared with torch's DataLoader (helper uvalues)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

import aioloader


def _one_worker_epoch(dataset: Any, batch_size: int, collate_fn: Any) -> list[Any]:
    loader = aioloader.DataLoader(dataset, batch_size=batch_size, num_workers=1,
                                  collate_fn=collate_fn, quiet=True)
    try:
        return list(loader)
    finally:
        loader.close()


class Bank:
    """A collate_fn that keeps every batch it collated (a memory bank across batches) and
    returns the batch with the mean of all it kept so far."""

    def __init__(self) -> None:
        self.bank: list[torch.Tensor] = []

    def __call__(self, samples: list[tuple[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        (batch,) = default_collate(samples)
        self.bank.append(batch)
        return batch, torch.stack(self.bank).mean()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_batch_the_collate_fn_keeps_is_not_overwritten(zero_copy: bool) -> None:
    # torch's default_collate stacks into the worker's arena slot. A collate_fn that keeps
    # what it collated saw it overwritten once the parent gave the slot back and the worker
    # filled it with a later batch: the bank's mean drifted from the 6th batch on (slot reuse).
    rows = TensorDataset(torch.arange(40.0).repeat_interleave(4).reshape(40, 4))  # row i: i
    loader = aioloader.DataLoader(rows, batch_size=2, num_workers=1, collate_fn=Bank(),
                                  zero_copy=zero_copy, quiet=True)
    try:
        got = [(batch[:, 0].tolist(), mean.item()) for batch, mean in loader]
    finally:
        loader.close()
    want = [([2.0 * k, 2.0 * k + 1], k + 0.5) for k in range(20)]
    assert got == want


def _channels_last(samples: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collate_fn for a channels_last model; it also returns a transposed (dense) view."""
    (images,) = default_collate(samples)
    return {"images": images.contiguous(memory_format=torch.channels_last),
            "columns": images.flatten(1).t()}


def test_a_dense_layout_comes_through_as_the_collate_fn_made_it() -> None:
    # torch's process workers send a tensor's storage with its strides: a channels_last batch
    # stays channels_last. Ours came out of the slot contiguous (same values, other layout).
    images = TensorDataset(torch.arange(6 * 3 * 4 * 5.0).reshape(6, 3, 4, 5))
    want = [_channels_last([images[i] for i in range(k, k + 3)]) for k in (0, 3)]  # torch's
    got = _one_worker_epoch(images, 3, _channels_last)
    assert len(got) == len(want) == 2
    for ours, theirs in zip(got, want, strict=True):
        for key in ("images", "columns"):
            assert torch.equal(ours[key], theirs[key])
            assert ours[key].stride() == theirs[key].stride(), key
        assert ours["images"].is_contiguous(memory_format=torch.channels_last)


def _one_tensor_twice(samples: list[tuple[torch.Tensor]]) -> dict[str, Any]:
    """Labels that are the inputs (a language model's collate), the same tensor object."""
    (ids,) = default_collate(samples)
    return {"input_ids": ids, "labels": ids, "pair": (ids, ids)}


@pytest.mark.parametrize("width", [4, 100_000])  # copied out, leased
def test_one_tensor_twice_in_a_batch_is_one_tensor(width: int) -> None:
    # torch pickles a batch whole: the same tensor twice comes back as one tensor (an in-place
    # change to the labels shows in the inputs, as in the worker). Ours came back as two
    # copies, and its bytes were written into the slot twice.
    rows = TensorDataset(torch.arange(4.0).repeat_interleave(width).reshape(4, width))
    batches = _one_worker_epoch(rows, 2, _one_tensor_twice)
    assert [b["input_ids"][:, 0].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0]]
    for b in batches:
        assert b["labels"] is b["input_ids"]
        assert b["pair"][0] is b["pair"][1] is b["input_ids"]
