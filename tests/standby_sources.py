"""Module-level datasets for tests/test_spawn_standby.py (spawned workers import them)."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch.utils.data import Dataset


class Tagged(Dataset[dict[str, Any]]):
    """Sample ``i``: ``i``, its value from a tensor the dataset holds, the dataset's tag,
    ``AIOLOADER_TAG`` in the environment and the pid of the process that fetched it."""

    def __init__(self, n: int) -> None:
        self.values = torch.arange(n) * 10
        self.tag = 0

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "value": self.values[i], "tag": self.tag,
                "env": os.environ.get("AIOLOADER_TAG", ""), "cwd": os.getcwd(),
                "pid": os.getpid()}


class Locked(Tagged):
    """Holds a lock: it does not pickle."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()
