"""Victim of the Ctrl-C test: SIGINT mid-epoch, then the same loader must work again.

usage: sigint_target.py sync|async
Prints {"pid", "workers"} once the first batch arrived, then {"ok": true, ...} at the end.
"""

import asyncio
import json
import os
import sys
import time

import aioloader
from aioloader.testing import SlowReader, descendants, is_alive, is_helper

N = 800
REPORTED: list[int] = []  # the workers of the epoch that gets interrupted


def workers() -> list[int]:
    return [p for p in descendants() if not is_helper(p)]


async def epoch_async(loader: aioloader.DataLoader, report: bool) -> list[int]:
    got: list[int] = []
    async for batch in loader:
        got.extend(batch["index"].tolist())
        if report and len(got) == 4:
            REPORTED.extend(workers())
            print(json.dumps({"pid": os.getpid(), "workers": REPORTED}), flush=True)
    return got


def epoch_sync(loader: aioloader.DataLoader, report: bool) -> list[int]:
    got: list[int] = []
    for batch in loader:
        got.extend(batch["index"].tolist())
        if report and len(got) == 4:
            REPORTED.extend(workers())
            print(json.dumps({"pid": os.getpid(), "workers": REPORTED}), flush=True)
    return got


def main() -> None:
    mode = sys.argv[1]
    loader = aioloader.DataLoader(SlowReader(N, delay=0.002), batch_size=4, num_workers=2,
                                  max_instances_in_memory=16, quiet=True)
    run = (lambda report: asyncio.run(epoch_async(loader, report))) if mode == "async" else (
        lambda report: epoch_sync(loader, report))
    try:
        run(True)
        print(json.dumps({"error": "the epoch ended before SIGINT"}), flush=True)
        return
    except KeyboardInterrupt:
        pass
    # Every worker of the interrupted epoch is gone (reaped) by the time we are here.
    alive = [p for p in REPORTED if is_alive(p)]
    t0 = time.monotonic()
    got = run(False)
    print(json.dumps({"ok": sorted(got) == list(range(N)), "alive_after_interrupt": alive,
                      "second_epoch_s": round(time.monotonic() - t0, 2), "count": len(got)}),
          flush=True)


if __name__ == "__main__":
    main()
