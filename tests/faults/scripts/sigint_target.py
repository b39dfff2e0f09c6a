"""Victim of the Ctrl-C test: SIGINT mid-epoch, then the same loader must work again.

usage: sigint_target.py sync|async
Prints {"pid", "workers"} once the first batch arrived, then {"ok": true, ...} at the end.

The interrupted epoch cannot end before the SIGINT comes, however busy the machine: its
workers stall (sleep for an hour) a few instances into the pass, after the batch that
triggers the report. The test sends SIGINT only once it has read that report from the
pipe, so nothing races. The second epoch runs on workers forked after the interrupt, from
the reader with the stall switched off.
"""

import asyncio
import json
import os
import signal
import sys
import time

import aioloader
from aioloader.testing import SlowReader, descendants, is_alive, is_helper

N = 800
STALL_AT = 8  # the instance (of the whole pass) before which the first epoch's workers stall
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
    # Ctrl-C in a terminal raises KeyboardInterrupt; a test run started in the background
    # of a non-interactive shell (`bash .ci/run &`) hands SIGINT down ignored, and Python
    # then installs no handler: the SIGINT would do nothing and the script run on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Each worker keeps every other instance: by instance STALL_AT both have sent a batch of
    # 4, so the report (after 4 instances) comes before any worker stalls.
    reader = SlowReader(N, delay=0.002, stall_at=STALL_AT, stall=3600.0)
    loader = aioloader.DataLoader(reader, batch_size=4, num_workers=2,
                                  max_instances_in_memory=16, quiet=True)
    run = (lambda report: asyncio.run(epoch_async(loader, report))) if mode == "async" else (
        lambda report: epoch_sync(loader, report))
    try:
        run(True)
        print(json.dumps({"error": "the epoch ended before SIGINT"}), flush=True)
        return
    except KeyboardInterrupt:
        pass
    reader.stall_at = None  # fork: the next epoch's workers see the reader as it is now
    # Every worker of the interrupted epoch is gone (reaped) by the time we are here.
    alive = [p for p in REPORTED if is_alive(p)]
    t0 = time.monotonic()
    got = run(False)
    print(json.dumps({"ok": sorted(got) == list(range(N)), "alive_after_interrupt": alive,
                      "second_epoch_s": round(time.monotonic() - t0, 2), "count": len(got)}),
          flush=True)


if __name__ == "__main__":
    main()
