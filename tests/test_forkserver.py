"""A forkserver starts with the loader and imports the dataset's module once, before it
forks workers (issue 13)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.deadline(120),
              pytest.mark.skipif(sys.platform != "linux", reason="forkserver: Linux")]

SCRIPT = textwrap.dedent("""
    import multiprocessing.forkserver
    import aioloader
    from aioloader.workers._starting import STARTER
    from preload_source import Pids

    loader = aioloader.DataLoader(Pids(), batch_size=2, num_workers=2,
                                  start_method="forkserver", quiet=True)
    STARTER.submit(lambda: None).result()  # the warm-up queued by the constructor is done
    print(multiprocessing.forkserver._forkserver._forkserver_pid)  # started already
    with loader:
        pairs = {(int(pid), int(ppid)) for pids, ppids in loader  # collated: two columns
                 for pid, ppid in zip(pids.tolist(), ppids.tolist())}
    print(" ".join(f"{pid}:{ppid}" for pid, ppid in sorted(pairs)))
""")


def test_a_forkserver_starts_with_the_loader_preloaded_with_the_dataset_module(
        tmp_path: pathlib.Path) -> None:
    log = tmp_path / "imports"
    # On the path the server inherits (it does not take the parent's sys.path edits).
    path = os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parent),
                                         os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "AIOLOADER_IMPORT_LOG": str(log), "PYTHONPATH": path}
    # A fresh interpreter: the forkserver reads its preload list once, when it starts.
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env,
        capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr
    server_line, workers_line = done.stdout.split("\n")[:2]
    pairs = [tuple(map(int, w.split(":"))) for w in workers_line.split()]
    workers = {pid for pid, _ in pairs}
    importers = [int(p) for p in log.read_text().split()]
    assert len(workers) == 2
    # Started when the loader was made, and the workers forked from it.
    assert server_line != "None" and {ppid for _, ppid in pairs} == {int(server_line)}
    # The script itself and the server import it; no worker does (each would pay for it).
    assert len(importers) == 2 and not workers & set(importers), (importers, workers)
