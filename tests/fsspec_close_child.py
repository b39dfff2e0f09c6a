"""FsspecReader over HTTP in 2 workers, closed with loads in flight, RUNS times: run by
test_fsspec_reader in a fresh interpreter (in pytest's, a forked worker's log records go to
pytest's handlers, not to stderr). Reads the URLs as JSON on stdin; stderr must be a file.
Prints one line a run: its number and the bytes its workers wrote to stderr (issue 19: 0).

    python fsspec_close_child.py RUNS < urls.json 2> stderr.txt
"""

from __future__ import annotations

import json
import os
import sys

import aioloader
from aioloader.readers import FsspecReader


def main(runs: int, urls: list[str]) -> None:
    for run in range(1, runs + 1):
        before = os.fstat(2).st_size
        loader = aioloader.DataLoader(FsspecReader(urls), batch_size=8, num_workers=2,
                                      concurrency=32, max_instances_in_memory=64, quiet=True)
        for seen, _ in enumerate(loader, 1):
            if seen == 10:  # the workers are still loading and sending
                break
        loader.close()
        print(run, os.fstat(2).st_size - before, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), json.load(sys.stdin))
