"""Victim of the stalled-workers kill -9 test: its workers stall, then it waits for the kill.

usage: stall_target.py START_METHOD slow|full DIRECTORY
Prints {"pid", "workers"} once every worker has stalled: in a slow ``__getitem__`` deaf to
EOF (slow: they say so on a FIFO in DIRECTORY), or on a full arena, the consumer keeping
the epoch's batches waiting after its first one (full).
"""

import asyncio
import json
import os
import sys

import victims
from fault_helpers import StallReports, arena_full

import aioloader


async def main(method: str, stall: str, directory: str) -> None:
    reports = StallReports(directory) if stall == "slow" else None
    if reports is not None:
        loader = aioloader.DataLoader(victims.Stalls(10_000, 8, reports.path), batch_size=2,
                                      num_workers=2, start_method=method, quiet=True)
    else:
        loader = aioloader.DataLoader(victims.PlainReader(1_000_000), batch_size=2,
                                      num_workers=2, max_instances_in_memory=8,
                                      start_method=method, quiet=True)
    async for _ in loader:
        if reports is not None:
            pids = await asyncio.to_thread(reports.wait, 2)
        else:
            pids = await arena_full(loader)
        print(json.dumps({"pid": os.getpid(), "workers": sorted(pids)}), flush=True)
        await asyncio.Event().wait()  # until the kill


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
