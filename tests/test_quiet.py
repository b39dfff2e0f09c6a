"""``quiet``: by default bars follow tqdm's convention (a terminal or a notebook, never a
redirected stderr), so a torch script ported by its import prints nothing into logs and CI
(issue 19); ``quiet=False`` and ``quiet=True`` are what the user asked.

Each loader runs in a fresh interpreter whose stderr is a pipe or a pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
import types

import pytest

from aioloader.run._bars import shows_bars

TIMEOUT = 120.0

# A map dataset, a reader (its cache fills first: the "loading instances" bar) and a torch
# IterableDataset, two epochs each.
SCRIPT = """
import torch, aioloader
class Ten(aioloader.Reader):
    def read(self, data_path):
        yield from range(10)
class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))
for nw in {workers!r}:
    for source in (list(range(10)), Ten(), Stream()):
        with aioloader.DataLoader(source, batch_size=4, num_workers=nw{quiet}) as loader:
            for _ in range(2):
                assert sum(len(b) for b in loader) >= 10
print("done")
"""


def _script(workers: list[int], quiet: bool | None = None) -> str:
    option = "" if quiet is None else f", quiet={quiet!r}"
    return SCRIPT.format(workers=workers, quiet=option)


def _run_piped(script: str) -> str:
    """Run script with its stderr a pipe (no TTY): what it wrote there."""
    proc = subprocess.run([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]
    return proc.stderr


def _run_on_a_tty(script: str) -> str:
    """Run script with a pseudo-terminal as its stderr: what the terminal got."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []
    try:
        # A fresh pty is 0x0; tqdm sizes its bar (dynamic_ncols) from it.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=slave) as proc:
            os.close(slave)
            slave = -1
            deadline = time.monotonic() + TIMEOUT
            while True:  # until every holder of the terminal (the child, its workers) is gone
                left = deadline - time.monotonic()
                if left <= 0:
                    proc.kill()
                    pytest.fail(f"no end of the terminal's output after {TIMEOUT:.0f}s")
                if not select.select([master], [], [], left)[0]:
                    continue
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: the other end is closed
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            assert proc.stdout is not None
            out = proc.stdout.read()
            returncode = proc.wait(timeout=TIMEOUT)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    got = b"".join(chunks).decode(errors="replace")
    assert returncode == 0 and out == b"done\n", got[-2000:]
    return got


@pytest.mark.deadline(TIMEOUT + 30)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_by_default_a_redirected_stderr_gets_nothing(num_workers: int) -> None:
    assert _run_piped(_script([num_workers])) == ""


@pytest.mark.deadline(TIMEOUT + 30)
def test_by_default_a_terminal_gets_bars() -> None:
    got = _run_on_a_tty(_script([0, 2]))
    assert "batches" in got and "batch/s" in got
    assert "loading instances" in got


@pytest.mark.deadline(TIMEOUT + 30)
def test_quiet_false_draws_bars_into_a_pipe() -> None:
    got = _run_piped(_script([0], quiet=False))
    assert "batches" in got and "loading instances" in got


@pytest.mark.deadline(TIMEOUT + 30)
def test_quiet_true_leaves_a_terminal_alone() -> None:
    assert _run_on_a_tty(_script([0], quiet=True)) == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_asks_stderr_then_a_notebook_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = io.StringIO()
    closed.close()  # isatty() raises ValueError
    for stderr in (None, object(), closed, io.StringIO()):  # pythonw, a stand-in, ...
        monkeypatch.setattr(sys, "stderr", stderr)
        assert not shows_bars(None)
        assert shows_bars(False)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert shows_bars(None)
    assert not shows_bars(True)

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # ipykernel's OutStream is no TTY
    kernelapp = types.ModuleType("ipykernel.kernelapp")

    class IPKernelApp:
        running = False

        @classmethod
        def initialized(cls) -> bool:
            return cls.running

    kernelapp.IPKernelApp = IPKernelApp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ipykernel.kernelapp", kernelapp)
    assert not shows_bars(None)  # imported, but no kernel runs
    IPKernelApp.running = True
    assert shows_bars(None)
    assert not shows_bars(True)
