"""Worker recycling (issue 12): max_batches_per_worker and max_worker_rss retire a worker
between batches; its successor starts ahead of the hand-over and goes on exactly where it
stopped. Copy-on-access memory growth (torch issue 13246) stays under the ceiling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from resume_sources import Items, Stream, SyncReader

import aioloader

VICTIM = Path(__file__).parent / "cow_victim.py"


@pytest.mark.deadline(180)
@pytest.mark.parametrize(("kind", "start_method"), [
    ("map", "fork"), ("lazy", "fork"), ("cached", "fork"), ("map", "spawn"),
])
def test_recycling_every_5_batches_keeps_every_batch_once_and_in_order(
        kind: str, start_method: str) -> None:
    # spawn starts a worker in a second or two: fewer recycles there, the same checks
    size = 800 if start_method == "fork" else 240
    source = Items(size) if kind == "map" else SyncReader(size)
    lazy = 16 if kind == "lazy" else None

    def make(**kw: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(source, batch_size=4, shuffle=True, seed=1, num_workers=2,
                                    start_method=start_method, max_instances_in_memory=lazy,
                                    quiet=True, **kw)

    with make() as reference:
        want = [b["i"].tolist() for b in reference]
    me = psutil.Process()
    before = {c.pid for c in me.children()}  # a helper of earlier tests (forkserver) stays
    seen: set[int] = set()  # pids that have served as a current worker
    most = 0
    with make(max_batches_per_worker=5) as loader:
        got = []
        for batch in loader:
            got.append(batch["i"].tolist())
            current = {w.pid for w in loader.stats().workers if w.pid is not None}
            seen |= current
            # Working: the current workers and successors not yet switched in. A retired
            # worker (seen, no longer current) may take a while to exit on a busy machine.
            most = max(most, _live_children(me, before | (seen - current)))
        stats = loader.stats()
    assert len(got) == size // 4 and got == want
    assert stats.recycles >= size // 4 // 5 * 3 // 8, stats  # 15 of 40 for 800 samples
    assert most <= 2 + 2, most  # each worker and at most one successor of its own
    assert _live_children(me, before) == 0  # every retired worker was reaped


def _live_children(me: psutil.Process, skip: set[int]) -> int:
    count = 0
    for child in me.children():
        try:  # a retired worker may exit between the listing and the look
            if child.pid not in skip and child.status() != psutil.STATUS_ZOMBIE:
                count += 1
        except psutil.NoSuchProcess:
            pass
    return count


def _cow(limit_mb: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, str(VICTIM), str(limit_mb)], capture_output=True,
                          text=True, timeout=240, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exact"] and result["batches"] == 24
    return result


@pytest.mark.deadline(300)
@pytest.mark.parametrize("max_batches", [1, 3])
def test_recycled_stream_workers_start_their_pass_again_after_an_epoch_left_early(
        max_batches: int) -> None:
    # persistent workers rewind a stream left early (issue 32); a worker that retires
    # meanwhile hands the rewind to its successor, asked before its first batch, so that
    # no successor retires in the pass dropped (before, max_batches=1 recycled forever)
    def epochs(**kw: int) -> list[list[int]]:
        with aioloader.DataLoader(Stream(20), batch_size=2, num_workers=2,
                                  persistent_workers=True, quiet=True, **kw) as loader:
            out = []
            for _ in range(3):
                for k, batch in enumerate(loader):
                    out.append(batch["i"].tolist())
                    if k == 1:
                        break
            return out + [batch["i"].tolist() for batch in loader]

    assert epochs(max_batches_per_worker=max_batches) == epochs()


def test_max_worker_rss_bounds_copy_on_access_growth() -> None:
    """~200 MB of Python objects, read by 2 workers: without a ceiling each worker's own
    memory grows toward its share of them; with max_worker_rss=40 MB it stays under the
    ceiling plus one batch (a batch touches 4 x 2 MB of objects)."""
    unbounded = _cow(0)
    bounded = _cow(40)
    assert unbounded["peak_uss_mb"] > 80, unbounded
    assert unbounded["recycles"] == 0
    assert bounded["peak_uss_mb"] <= 40 + 8 + 4, bounded
    assert bounded["recycles"] >= 2, bounded


def test_recycling_options_are_validated() -> None:
    for name in ("max_batches_per_worker", "max_worker_rss"):
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match=f"{name} must be None or an int >= 1"):
                aioloader.DataLoader([1], batch_size=1, **{name: bad})
