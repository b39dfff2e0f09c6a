"""The S3 reader on each torch.distributed rank (spawned: module level; issue 11).

The test starts the S3 server and passes its storage options in the environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import aioloader
from aioloader.readers import FsspecReader

S3_ENV = "AIOLOADER_TEST_S3"


def case_s3_two_workers(rank: int, world: int) -> dict[str, Any]:
    options = json.loads(os.environ[S3_ENV])
    reader = FsspecReader("s3://shards/train/*.bin", storage_options=options,
                          decode=_name)
    epochs = []
    with aioloader.DataLoader(reader, batch_size=4, num_workers=2, concurrency=8,
                              retries=2, quiet=True) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([name for batch in loader for name in batch])
    return {"epochs": epochs}


def _name(url: str, data: bytes) -> str:
    assert data == url.rsplit("/", 1)[1].encode() * 50, url  # the object's own bytes
    return url.rsplit("/", 1)[1]


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "s3_two_workers": case_s3_two_workers,
}
