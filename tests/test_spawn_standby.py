"""A spawn loader starts standby processes when it is made; its first epoch's workers are
those processes, given the dataset as it is when the epoch starts (aioloader/_standby.py,
issue 13)."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import psutil
import pytest
from standby_sources import Locked, Tagged

import aioloader

pytestmark = [pytest.mark.deadline(120),
              pytest.mark.skipif(sys.platform != "linux", reason="SCM_RIGHTS hand-off: Linux")]


def spawn_loader(dataset: Any, **options: Any) -> aioloader.DataLoader:
    return aioloader.DataLoader(dataset, batch_size=2, num_workers=2, start_method="spawn",
                                quiet=True, **options)


def standby_pids(loader: aioloader.DataLoader) -> set[int]:
    pool = loader._run.owned.standby
    assert pool is not None
    pids = pool.pids()  # once started
    assert None not in pids and len(pids) == 2
    return {pid for pid in pids if pid is not None}


def pids_of(batches: list[dict[str, Any]]) -> set[int]:
    return {int(pid) for b in batches for pid in b["pid"].tolist()}


def contents(batches: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(b["i"].tolist(), b["value"].tolist(), b["tag"].tolist(), b["env"], b["cwd"])
            for b in batches]


def gone(pids: set[int]) -> bool:
    """Reaped: a standby's pid is neither running nor a zombie."""
    return not any(psutil.pid_exists(pid) for pid in pids)


def test_the_first_epoch_runs_in_the_standby_processes() -> None:
    with spawn_loader(Tagged(10), persistent_workers=True) as loader:
        standbys = standby_pids(loader)
        first = list(loader)
        assert pids_of(first) == standbys
        assert pids_of(list(loader)) == standbys  # persistent workers: the same ones
    with aioloader.DataLoader(Tagged(10), batch_size=2, num_workers=2, quiet=True) as forked:
        assert contents(first) == contents(list(forked))
    assert gone(standbys)


def test_the_workers_see_the_dataset_and_surroundings_as_they_are_when_the_epoch_starts(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = Tagged(6)
    with spawn_loader(dataset) as loader:
        standbys = standby_pids(loader)  # started before anything changed
        dataset.tag = 7
        dataset.values.add_(1)  # in place, in the tensor the dataset holds
        monkeypatch.setenv("AIOLOADER_TAG", "later")
        monkeypatch.chdir(tmp_path)
        batches = list(loader)
    assert pids_of(batches) == standbys
    assert [v for b in batches for v in b["value"].tolist()] == [1, 11, 21, 31, 41, 51]
    assert {t for b in batches for t in b["tag"].tolist()} == {7}
    assert {e for b in batches for e in b["env"]} == {"later"}
    assert {c for b in batches for c in b["cwd"]} == {str(tmp_path)}


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_loader_that_never_iterated_leaves_no_process(how: str) -> None:
    loader = spawn_loader(Tagged(4), persistent_workers=False)
    standbys = standby_pids(loader)
    if how == "close":
        loader.close()  # reaped before it returns
        assert gone(standbys)
        # Iterated after all: workers spawned then, as without standbys.
        assert pids_of(list(loader)) - standbys and gone(standbys)
        loader.close()
    else:
        del loader
        gc.collect()  # the garbage collector's backstop reaps them
        assert gone(standbys)


def test_an_unpicklable_dataset_starts_no_process_and_fails_clearly() -> None:
    with spawn_loader(Locked(4)) as loader:
        pool = loader._run.owned.standby
        assert pool is not None and pool.pids() == []  # the pool pickles the spec first
        with pytest.raises(aioloader.SourcePicklingError, match=r"the source \(Locked\)"):
            next(iter(loader))


def test_two_spawn_loaders_at_once() -> None:
    with spawn_loader(Tagged(8)) as a, spawn_loader(Tagged(8)) as b:
        ours_a, ours_b = standby_pids(a), standby_pids(b)
        assert not ours_a & ours_b
        pairs = list(zip(a, b, strict=True))  # both epochs in flight together
        assert pids_of([x for x, _ in pairs]) == ours_a
        assert pids_of([y for _, y in pairs]) == ours_b
        assert contents([x for x, _ in pairs]) == contents([y for _, y in pairs])


def test_a_resumed_loader_keeps_its_standbys() -> None:
    with spawn_loader(Tagged(8)) as loader:
        state = loader.state_dict()
        standbys = standby_pids(loader)
        loader.load_state_dict(state)
        assert pids_of(list(loader)) == standbys


KILLED = textwrap.dedent("""
    import os, signal
    from multiprocessing.connection import wait
    import aioloader
    from standby_sources import Tagged

    if __name__ == "__main__":
        loader = aioloader.DataLoader(Tagged(8), batch_size=2, num_workers=2,
                                      start_method="spawn", quiet=True)
        pool = loader._run.owned.standby
        victim, survivor = pool.pids()
        os.kill(victim, signal.SIGKILL)
        sentinel = next(s.process.sentinel for s in pool._idle if s.process.pid == victim)
        assert wait([sentinel], timeout=60), "the killed standby did not exit"
        with loader:
            batches = list(loader)
        pids = {int(p) for b in batches for p in b["pid"].tolist()}
        values = [v for b in batches for v in b["value"].tolist()]
        print(victim, survivor, " ".join(map(str, sorted(pids))), values)
""")


def test_a_standby_killed_before_the_first_epoch_is_replaced(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "killed.py"  # a file: spawned processes import the main module
    script.write_text(KILLED)
    path = os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parent),
                                         os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr
    victim, survivor, *rest = done.stdout.split()
    pids = {int(p) for p in rest[:-8]}
    assert "".join(rest[-8:]) == "[0,10,20,30,40,50,60,70]", done.stdout
    assert int(survivor) in pids and int(victim) not in pids and len(pids) == 2
    assert "Traceback" not in done.stderr, done.stderr  # no error: a fresh process instead
