"""A dataset that takes a known time per sample (spawned workers import it by name)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class Paced(Dataset[torch.Tensor]):
    """Sample ``i`` takes ``seconds`` of wall time in the process that fetches it."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)  # the work being measured, not a synchronisation
        return torch.full((256,), i, dtype=torch.float32)
