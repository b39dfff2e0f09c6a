"""zero_copy: large batches are leased views of a slot by default; zero_copy=False copies."""

from __future__ import annotations

import pytest
import torch

import aioloader


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 128, 128), i, dtype=torch.uint8)  # 48 KiB: 384 KiB a batch


def _storage_bytes(loader: aioloader.DataLoader) -> list[tuple[int, int]]:
    out = []
    for batch in loader:
        out.append((batch.untyped_storage().nbytes(), batch.numel()))
    return out


@pytest.mark.parametrize("zero_copy", [True, False])
def test_zero_copy_false_gives_batches_of_their_own_memory(zero_copy: bool) -> None:
    loader = aioloader.DataLoader(Images(), batch_size=8, num_workers=1, quiet=True,
                                  zero_copy=zero_copy)
    try:
        sizes = _storage_bytes(loader)
        batches = list(loader)
    finally:
        loader.close()
    assert [int(b[:, 0, 0, 0].sum()) for b in batches] == [sum(range(8)), sum(range(8, 16))]
    # a lease is a view of its whole slot (a slot has headroom); a copy owns exactly its bytes
    leased = [storage > numel for storage, numel in sizes]
    assert leased == [zero_copy] * 2
