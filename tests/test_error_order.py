"""Errors keep their place (issue 19, item 7), and forked workers leave inherited objects be.

* In-order delivery: a worker's exception is raised when its batch is due, after every
  earlier batch, as with torch's DataLoader. Batch 0 (worker 0) is held back until the
  worker that fails batch 1 is gone or has moved on, so the failure is certainly known
  first: a socket it connects before raising, whose EOF worker 0 waits for.
* A forked worker never finalizes what it inherited: a torch DataLoader iterator left
  behind in a reference cycle was collected in our workers, whose stderr then filled with
  torch's "AssertionError: can only test a child process".
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

import aioloader

FAIL_AT = 2  # the first item of batch 1 (batch_size 2)
DEADLINE = 60.0  # seconds a held-back item waits for the gate before it gives up

_HELD: list[socket.socket] = []  # the failing process's end of the gate, until it moves on


def _release_gate() -> None:
    while _HELD:
        _HELD.pop().close()


def _connect(gate: socket.socket) -> None:
    """Hold a connection to ``gate`` open until this process exits or fetches again."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(gate.getsockname())
    _HELD.append(conn)


def _await_gate(gate: socket.socket) -> None:
    """Wait until the failing process let go of its connection (EOF)."""
    gate.settimeout(DEADLINE)
    conn, _ = gate.accept()
    with conn:
        conn.settimeout(DEADLINE)
        assert conn.recv(1) == b""


class GatedFailure(torch.utils.data.Dataset[torch.Tensor]):
    """Item ``FAIL_AT`` raises KeyError. With a ``gate`` (a listening socket the forked
    workers inherit), item 0 first waits until the failing process has exited (ours:
    after it reported the error) or fetched its next item (torch's workers outlive their
    exceptions): no sleep decides what is known first."""

    def __init__(self, n: int = 8, gate: socket.socket | None = None, *,
                 fail: bool = True) -> None:
        self.n = n
        self.gate = gate
        self.fail = fail

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.fail and i == FAIL_AT:
            if self.gate is not None:
                _connect(self.gate)
            raise KeyError(f"no item {i}")
        _release_gate()
        if self.gate is not None and i == 0:
            _await_gate(self.gate)
        return torch.tensor(i)


class GatedStream(aioloader.Reader):
    """Worker 0 streams ``0, 1, ...`` (its first instance held back as above); worker 1
    raises KeyError before its first instance."""

    manual_multiprocess_sharding = True

    def __init__(self, gate: socket.socket) -> None:
        self.gate = gate

    def read(self, data_path: Any = None) -> Iterator[int]:
        info = aioloader.get_worker_info()
        assert info is not None
        if info.id == 1:
            _connect(self.gate)
            raise KeyError("worker 1 has no data")
        _await_gate(self.gate)
        yield from range(4)


@contextmanager
def gate() -> Iterator[socket.socket]:
    """A listening socket in the abstract namespace (nothing on disk to clean up)."""
    with closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as sock:
        sock.bind("")  # Linux: an autobound abstract address
        sock.listen(4)
        yield sock


def consume(loader: Any, face: str) -> tuple[list[Any], BaseException]:
    """The batches before the iteration raised, and what it raised."""
    got: list[Any] = []
    if face == "sync":
        batches = iter(loader)
        try:
            with pytest.raises(Exception) as info:  # the caller checks which
                for batch in batches:
                    got.append(batch)
        finally:
            # torch's iterator stops its workers only when collected, and the traceback
            # keeps it alive: stop them now, not at the leak check's deadline.
            getattr(batches, "_shutdown_workers", lambda: None)()
        return got, info.value

    async def run() -> None:
        async for batch in loader:
            got.append(batch)

    with pytest.raises(Exception) as info:
        asyncio.run(asyncio.wait_for(run(), DEADLINE * 2))
    return got, info.value


def test_torch_raises_batch_1_after_batch_0() -> None:
    """The reference: torch delivers batch 0, then raises batch 1's KeyError."""
    with gate() as g:
        loader = torch.utils.data.DataLoader(GatedFailure(gate=g), batch_size=2,
                                             num_workers=2, multiprocessing_context="fork")
        got, err = consume(loader, "sync")
    assert [b.tolist() for b in got] == [[0, 1]]
    assert isinstance(err, KeyError) and "no item 2" in str(err)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_worker_error_waits_for_earlier_batches(face: str) -> None:
    with gate() as g:
        source = GatedFailure(gate=g)
        loader = aioloader.DataLoader(source, batch_size=2, num_workers=2, quiet=True)
        with loader:
            got, err = consume(loader, face)
            assert [b.tolist() for b in got] == [[0, 1]]
            assert isinstance(err, aioloader.WorkerError), repr(err)
            assert not isinstance(err, aioloader.WorkerDied)
            assert isinstance(err, KeyError)  # `except KeyError:` works, as with torch
            assert isinstance(err.__cause__, KeyError)
            assert "no item 2" in str(err) and "worker 1 (pid" in str(err)
            # The failed batch was handed over, as its error: the iteration would go on with
            # batch 2 (torch's), and so does a resume from a state taken now ...
            state = loader.state_dict()
            source.fail = False  # fork: the next workers see the healed dataset
            again = aioloader.DataLoader(GatedFailure(fail=False), batch_size=2, quiet=True)
            again.load_state_dict(state)
            with again:
                assert [b.tolist() for b in again] == [[4, 5], [6, 7]]
            # ... and the next epoch starts the pass again, as after any error.
            source.gate = None
            assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("timeout", [None, 30.0])  # 30: fetched in a thread, off the loop
@pytest.mark.parametrize("face", ["sync", "async"])
def test_no_workers_raise_in_order_too(face: str, timeout: float | None) -> None:
    for loader in (torch.utils.data.DataLoader(GatedFailure(), batch_size=2),
                   aioloader.DataLoader(GatedFailure(), batch_size=2, timeout=timeout,
                                        quiet=True)):
        if face == "async" and not isinstance(loader, aioloader.DataLoader):
            continue
        got, err = consume(loader, face)
        assert [b.tolist() for b in got] == [[0, 1]]
        assert isinstance(err, KeyError) and "no item 2" in str(err)
        if isinstance(loader, aioloader.DataLoader):
            loader.close()


@pytest.mark.parametrize("face", ["sync", "async"])
def test_stream_error_waits_its_turn(face: str) -> None:
    """Streams are taken round-robin: worker 0's first batch is due before worker 1's."""
    with gate() as g:
        loader = aioloader.DataLoader(GatedStream(g), batch_size=1, num_workers=2,
                                      max_instances_in_memory=4, quiet=True)
        with loader:
            got, err = consume(loader, face)
    assert [b.tolist() for b in got] == [[0]]
    assert isinstance(err, aioloader.WorkerError) and isinstance(err, KeyError), repr(err)
    assert "worker 1 has no data" in str(err)


LEFTOVERS = textwrap.dedent("""
    import faulthandler
    import gc
    import os
    import signal
    import sys
    import threading
    import time
    import weakref

    import torch
    import torch.utils.data

    import aioloader

    collected = False


    def stacks_on_sigusr1(worker_id):
        # (not dump_traceback_later: in a forked child it waits for the parent's watchdog
        # thread, which the child does not have, and hangs the worker itself)
        faulthandler.register(signal.SIGUSR1, all_threads=True)


    def watchdog():
        # A hang shows where, before the deadline: the workers' stacks, then ours.
        if not done.wait(60):
            for pid in children():
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1)  # (the workers write theirs; nothing waits on it but this dump)
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)


    def children():
        me = str(os.getpid())
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if entry.isdigit() and f.read().rsplit(")", 1)[1].split()[1] == me:
                        yield int(entry)
            except OSError:
                pass


    done = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            global collected
            if aioloader.get_worker_info() is not None and not collected:
                collected = True  # once a worker (a forked child keeps its own flag)
                gc.collect()  # our worker's GC runs: it must find nothing inherited to end
            return torch.tensor([i])

    made = []  # weak: the iterators stay garbage, yet can be stopped in order at the end

    def torch_iter(**kwargs):
        it = iter(torch.utils.data.DataLoader(Items(), batch_size=4, num_workers=2,
                                              multiprocessing_context="fork", **kwargs))
        next(it)
        made.append(weakref.ref(it))
        return it

    # Leftovers, all made before any is dropped (torch's own workers would otherwise
    # collect the earlier ones: torch's bug, not the one under test).
    dropped = torch_iter()
    kept = torch_iter()
    in_cycle = torch_iter()
    persistent_in_cycle = torch_iter(persistent_workers=True)
    ours = aioloader.DataLoader(Items(), batch_size=4, num_workers=2, quiet=True)
    ours_it = iter(ours)
    next(ours_it)
    del dropped  # finalized here and now
    cycle = [in_cycle, persistent_in_cycle, ours, ours_it]
    cycle.append(cycle)
    del in_cycle, persistent_in_cycle, ours, ours_it, cycle  # garbage, not yet collected

    loader = aioloader.DataLoader(Items(), batch_size=4, num_workers=2, quiet=True,
                                  worker_init_fn=stacks_on_sigusr1)
    with loader:
        for _ in range(2):
            assert sorted(int(i) for b in loader for i in b) == list(range(32))
    del kept
    # The leftovers end here, in the process that owns them: newest first, since each torch
    # worker holds its elders' queues (in any other order torch waits 5 s per worker).
    for ref in reversed(made):
        if (it := ref()) is not None:
            it._shutdown_workers()
    del it
    gc.collect()
    done.set()
    print("epochs done", flush=True)
""")


def test_forked_workers_leave_inherited_objects_alone(tmp_path: Path) -> None:
    """Two runs out of about 15 under load once waited forever for the new loader's batch
    (2026-12-03, cause not found); 60 runs of the script at load 11-14 on 12-06 did not. A
    hang, if one comes again, prints every worker's stack and the parent's."""
    script = tmp_path / "leftovers.py"
    script.write_text(LEFTOVERS)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "epochs done" in done.stdout
    assert "can only test a child process" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
