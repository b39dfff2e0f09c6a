"""A forkserver imports the dataset's module once, before it forks workers (issue 13)."""

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
    import aioloader
    from preload_source import Pids

    loader = aioloader.DataLoader(Pids(), batch_size=2, num_workers=2,
                                  start_method="forkserver", quiet=True)
    with loader:
        workers = {pid for batch in loader for pid in batch.tolist()}
    print(" ".join(map(str, sorted(workers))))
""")


def test_workers_fork_from_a_server_that_imported_the_dataset_module(
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
    workers = {int(p) for p in done.stdout.split()}
    importers = [int(p) for p in log.read_text().split()]
    assert len(workers) == 2
    # The script itself and the server import it; no worker does (each would pay for it).
    assert len(importers) == 2 and not workers & set(importers), (importers, workers)
