"""A dataset module that records every process importing it (tests/test_forkserver.py)."""

from __future__ import annotations

import os

import torch.utils.data as tud

with open(os.environ["AIOLOADER_IMPORT_LOG"], "a") as log:
    log.write(f"{os.getpid()}\n")


class Pids(tud.Dataset[list[int]]):
    """Sample ``i``: the pid of the process that fetched it, and its parent's."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> list[int]:
        return [os.getpid(), os.getppid()]
