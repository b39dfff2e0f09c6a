"""zero_copy: large batches are leased views of a slot by default; zero_copy=False copies."""

from __future__ import annotations

import sys

import pytest
import torch

import aioloader


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 128, 128), i, dtype=torch.uint8)  # 48 KiB: 384 KiB a batch


def _in_an_arena(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a worker's arena mapping (a lease), per /proc/self/maps."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "memfd:aioloader" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("zero_copy", [True, False])
def test_zero_copy_false_gives_batches_of_their_own_memory(zero_copy: bool) -> None:
    loader = aioloader.DataLoader(Images(), batch_size=8, num_workers=1, quiet=True,
                                  zero_copy=zero_copy)
    try:
        leased = [_in_an_arena(batch) for batch in loader]
        sums = [int(b[:, 0, 0, 0].sum()) for b in loader]
    finally:
        loader.close()
    assert sums == [sum(range(8)), sum(range(8, 16))]
    assert leased == [zero_copy] * 2


def _torch_collate_noting_where(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch's default_collate, as a user's collate calls it; notes where the batch lies."""
    stacked = torch.utils.data.default_collate(batch)
    return {"x": stacked, "torch_shared": torch.tensor(stacked.is_shared()),
            "in_arena": torch.tensor(_in_an_arena(stacked))}


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_torch_default_collate_stacks_into_the_arena_not_a_new_segment(
        start_method: str) -> None:
    """Passed as collate_fn (or called by one), torch's default_collate sees our worker info
    and would put every batch in a new shared-memory segment (issue 13); in our workers it
    stacks into the arena's slot, and the batch is exactly torch's."""
    with aioloader.DataLoader(Images(), batch_size=4, num_workers=2, start_method=start_method,
                              collate_fn=_torch_collate_noting_where, quiet=True) as loader:
        batches = list(loader)
    assert len(batches) == 4
    for k, batch in enumerate(batches):
        assert not batch["torch_shared"].item()  # no segment of torch's per batch
        # (a worker's first batch sizes its arena: it is made before the arena exists)
        assert batch["in_arena"].item() or k < 2  # written in place
        want = torch.utils.data.default_collate([Images()[i] for i in range(4 * k, 4 * k + 4)])
        assert torch.equal(batch["x"], want)
