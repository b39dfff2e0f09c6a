"""Victim of the kill -9 test: iterate forever; print our pid and worker pids once up.

usage: kill_target.py START_METHOD LAZY(0|1)
"""

import json
import os
import sys

import aioloader
from aioloader.testing import SlowReader, descendants


def main() -> None:
    method, lazy = sys.argv[1], sys.argv[2] == "1"
    loader = aioloader.DataLoader(SlowReader(100_000 if lazy else 400, delay=0.001),
                                  batch_size=4, num_workers=2, start_method=method,
                                  max_instances_in_memory=16 if lazy else None, quiet=True)
    reported = False
    while True:
        for _batch in loader:
            if not reported:
                print(json.dumps({"pid": os.getpid(), "tree": descendants()}), flush=True)
                reported = True


if __name__ == "__main__":
    main()
