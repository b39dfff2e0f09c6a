"""Users' scripts about a loader's lifetime and its two faces (sync and async), each checked
against torch's DataLoader where torch has the same thing. The autouse leak check
(tests/conftest.py) finds nothing left behind."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from core_sources import Squares
from torch.utils.data import DataLoader as TorchLoader

import aioloader


def indices(loader: Any) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


def _epoch_in_child(loader: Any, conn: Any, face: str) -> None:
    try:
        if face == "sync":
            got = indices(loader)
        else:
            async def consume() -> list[list[int]]:
                return [b["index"].tolist() async for b in loader]

            got = asyncio.run(consume())
        loader.close()  # the child's own workers
        conn.send(got)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which asserts
        conn.send(f"{type(err).__name__}: {err}")


@pytest.mark.parametrize(("persistent", "mid_epoch", "worker_type", "face"), [
    (False, True, "process", "sync"), (True, True, "process", "sync"),
    (True, False, "process", "async"), (True, True, "thread", "sync")])
def test_a_forked_child_iterates_the_loader_it_inherited(
        persistent: bool, mid_epoch: bool, worker_type: str, face: str) -> None:
    # A user's Process(target=train, args=(loader,)) under fork, while the parent's loader
    # has workers (mid-epoch, or persistent): the child's epoch closed or attached to the
    # parent's session ("can only join a child process", "Invalid file descriptor: -1").
    # torch's loader starts workers of the child's own; ours now does too.
    loader = aioloader.DataLoader(Squares(12), batch_size=4, num_workers=2,
                                  persistent_workers=persistent, worker_type=worker_type)
    want = indices(TorchLoader(Squares(12), batch_size=4))
    assert indices(loader) == want
    it = iter(loader)
    if mid_epoch:
        next(it)
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_epoch_in_child, args=(loader, theirs, face))
    child.start()
    theirs.close()
    try:
        assert ours.poll(60), "the child gave nothing in 60 s"
        assert ours.recv() == want
        child.join(30)
        assert child.exitcode == 0
        assert [b["index"].tolist() for b in it] == (want[1:] if mid_epoch else want)
        assert indices(loader) == want  # the parent's workers were untouched
    finally:
        child.join(30)
        ours.close()
        loader.close()


class Interrupted(Squares):
    """Ctrl-C arriving while index 5 is fetched (num_workers=0 fetches in the caller's
    thread), raised at a known point rather than sent at a random time."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 5:
            raise KeyboardInterrupt
        return super().__getitem__(i)


def test_ctrl_c_in_the_sync_face_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # The portal's task ended with the KeyboardInterrupt that _drive re-raised without
    # retrieving it: when the task was collected, asyncio logged "Task exception was never
    # retrieved" and the whole traceback again, under the user's own KeyboardInterrupt.
    loader = aioloader.DataLoader(Interrupted(12), batch_size=4)
    got: list[list[int]] = []
    with pytest.raises(KeyboardInterrupt):
        for b in loader:
            got.append(b["index"].tolist())
    assert got == [[0, 1, 2, 3]]
    gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    loader.close()


class TwoArguments(Exception):
    """An exception whose type cannot be made from its message alone."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


class HoldsALock(Exception):
    """An exception that cannot be pickled (its attribute cannot)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class RaisesAt2(Squares):
    def __init__(self, error: type[Exception]) -> None:
        super().__init__(4)
        self.error = error

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 2:
            raise TwoArguments(1, 2) if self.error is TwoArguments else self.error("no pickle")
        return super().__getitem__(i)


def _raised(cls: Any, dataset: Any) -> BaseException:
    with pytest.raises(Exception) as caught:
        for _ in cls(dataset, batch_size=1, num_workers=1):
            pass
    return caught.value


@pytest.mark.parametrize("error", [TwoArguments, HoldsALock])
def test_a_worker_exception_that_cannot_travel_is_of_torchs_type(error: type[Exception]) -> None:
    # Its pickle did not survive the round trip, so the parent had only its text and raised a
    # plain WorkerError: neither the RuntimeError that torch raises where the type refuses
    # `type(exc)(message)`, nor the original type where it accepts it (torch rebuilds that).
    torchs = type(_raised(TorchLoader, RaisesAt2(error)))
    assert torchs is (RuntimeError if error is TwoArguments else error)
    ours = _raised(aioloader.DataLoader, RaisesAt2(error))
    assert isinstance(ours, aioloader.WorkerError)
    assert isinstance(ours, torchs)
    assert "Traceback from the worker" in str(ours)


class ExitsAt2(Squares):
    """``sys.exit(3)`` in ``__getitem__``: torch's worker process ends there."""

    def __init__(self) -> None:
        super().__init__(4)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 2:
            sys.exit(3)
        return super().__getitem__(i)


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_worker_that_exits_is_a_runtime_error_as_torchs(worker_type: str) -> None:
    # A SystemExit is no Exception: it cannot be mixed into a WorkerError, so the parent
    # raised a plain WorkerError where torch raises RuntimeError ("DataLoader worker (pid N)
    # exited unexpectedly with exit code 3"; not run here: torch's SIGCHLD handler then fires
    # inside pytest, and its dead iterator's pipes and shared memory outlive the test).
    with pytest.raises(RuntimeError, match=r"raised SystemExit\(3\)") as caught:
        for _ in aioloader.DataLoader(ExitsAt2(), batch_size=1, num_workers=1,
                                      worker_type=worker_type):
            pass
    assert isinstance(caught.value, aioloader.WorkerError)


_COLLECTED_UNDER_A_LOCK = """
import concurrent.futures.thread as cft, gc, sys
sys.path.insert(0, {tests!r})
import aioloader
from core_sources import Squares
loader = aioloader.DataLoader(Squares(40), batch_size=4, num_workers=1)
it = iter(loader)
next(it)
cycle = [it, loader]
cycle.append(cycle)
del it, cycle
with cft._global_shutdown_lock:  # as an executor's submit() holds it, starting a thread
    gc.collect()  # the dropped epoch's backstop runs here
print("collected", len(list(loader)), flush=True)
loader.close()
"""


def test_an_epoch_collected_where_a_lock_is_held_does_not_deadlock() -> None:
    # The sync face's backstop closed the dropped epoch in the collecting thread, and that
    # close submits to an executor, which takes concurrent.futures' global lock: a
    # collection in a thread holding it (an executor's submit() starting a thread, where the
    # new thread or the submitting one collects) waited for it forever. Seen in a script
    # that dropped half-done loaders in one thread while another iterated its own.
    code = _COLLECTED_UNDER_A_LOCK.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "collected 10\n"


def test_uvloop_is_imported_with_aioloader_not_in_a_worker() -> None:
    # A worker forked while another thread of the parent imported uvloop for the first time
    # (each of two threads starting its first loader) inherited that import's module lock,
    # held, and its own `import uvloop` waited forever. Imported with aioloader, before any
    # thread of ours exists, no worker imports it.
    pytest.importorskip("uvloop")
    code = "import sys, aioloader; print('uvloop' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "True\n", done.stderr
