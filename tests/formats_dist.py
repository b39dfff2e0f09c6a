"""The rank entry point of the format readers' distributed tests (spawn pickles it): each
rank reads with 2 workers, whole, then interrupted after ``cut`` batches and resumed from
its state on a fresh loader; it writes what it saw."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

import aioloader
from aioloader.readers import ParquetReader, WebDatasetReader


def make(kind: str, where: str, workers: int) -> aioloader.DataLoader:
    if kind == "webdataset":
        reader: Any = WebDatasetReader(os.path.join(where, "shard-{000..005}.tar"),
                                       decode=True, shuffle_shards=True, seed=5)
    else:
        reader = ParquetReader(os.path.join(where, "*.parquet"), columns=["i", "text"])
    return aioloader.DataLoader(reader, batch_size=3, shuffle=True, seed=1, num_workers=workers,
                                max_instances_in_memory=6, even_batches=False, quiet=True)


def ids(batch: Any, kind: str) -> list[int]:
    return [int(i) for i in (batch["cls"] if kind == "webdataset" else batch["i"]).tolist()]


def rank_main(rank: int, world: int, port: int, out_dir: str, kind: str, where: str,
              cut: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with make(kind, where, 2) as loader:
            whole = [ids(b, kind) for b in loader]
        with make(kind, where, 2) as loader:
            batches = iter(loader)
            before = [ids(next(batches), kind) for _ in range(cut)]
            state = json.loads(json.dumps(loader.state_dict()))
        with make(kind, where, 2) as loader:
            loader.load_state_dict(state)
            after = [ids(b, kind) for b in loader]
        with open(os.path.join(out_dir, f"{kind}-rank{rank}.json"), "w") as f:
            json.dump({"whole": whole, "before": before, "after": after}, f)
    finally:
        dist.destroy_process_group()
