"""Batch values as users' code sees them, compared with torch's DataLoader (helper uvalues)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

import aioloader


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
