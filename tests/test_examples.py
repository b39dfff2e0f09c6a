"""Every example runs end to end in smoke mode (AIOLOADER_SMOKE=1) and leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 180

# example -> lines its output must contain
EXPECTED = {
    "train_lm.py": ["train loss", "(decreased)", "waited for data", "eval loss"],
    "sync_training.py": ["batches on", "loss"],
    "custom_reader.py": ["all 20 records, each exactly once"],
    "distributed.py": ["rank 0:", "rank 1:", "the union is the dataset"],
    "train_from_s3.py": ["uploaded 128 images", "epoch 1: loss", "data stall", "loader.stats()"],
}


def run_example(name: str, tmp_path: pathlib.Path) -> str:
    env = dict(os.environ, AIOLOADER_SMOKE="1", PYTHONUNBUFFERED="1")
    args = [sys.executable, str(EXAMPLES / name)]
    if name == "train_lm.py":
        args += ["--checkpoint", str(tmp_path / "lm.pt")]
    returncode, out = run_script(args, tmp_path, env)
    assert returncode == 0, f"{name} exited with {returncode}:\n{out[-3000:]}"
    return out


def run_script(args: list[str], cwd: pathlib.Path, env: dict[str, str],
               timeout: float = TIMEOUT) -> tuple[int, str]:
    """``args`` run to its end: its exit status, and its stdout and stderr together. It
    runs in a session of its own, so that the whole tree can be killed and checked for
    leftovers: every descendant must be gone with the script."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args[1:]} did not finish within {timeout} s:\n{out[-3000:]}")
    finally:
        leftovers = _still_alive(_group_alive(proc.pid), GRACE)
        if leftovers:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not leftovers, f"{args[1:]} left processes behind: {leftovers}"
    return proc.returncode, out


GRACE = 10.0  # multiprocessing's resource tracker ends when it reads its pipe's EOF, which
# the script's exit sends: on a busy machine it may still be running as the script is reaped


def _still_alive(pids: list[int], grace: float) -> dict[int, str]:
    """Those of ``pids`` still running after ``grace`` seconds, with their command lines;
    waited for on their pidfds (they are not our children), not by polling."""
    fds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[os.pidfd_open(pid)] = pid
    try:
        deadline = time.monotonic() + grace
        while fds and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(fds), [], [], left)
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return {pid: _cmdline(pid) for pid in fds.values()}
    finally:
        for fd in fds:
            os.close(fd)


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def _group_alive(pgid: int) -> list[int]:
    """The live processes (zombies aside) of process group ``pgid``."""
    alive = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it just exited
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in "ZX":
            alive.append(int(stat.parent.name))
    return alive


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str, tmp_path: pathlib.Path) -> None:
    out = run_example(name, tmp_path)
    for line in EXPECTED[name]:
        assert line in out, f"{name}: {line!r} missing from its output:\n{out[-3000:]}"
    # Its output goes to a pipe: no progress bar's redraws there, the loader's or its own,
    # as the loader's quiet=None has it (issue 36: train_lm.py wrote 46 KB of them to a log).
    assert "\r" not in out, f"{name} drew a progress bar into a pipe:\n{out[-3000:]}"
    if name == "train_lm.py":
        import torch

        checkpoint = torch.load(tmp_path / "lm.pt")
        assert checkpoint["step"] == 12 and "embed.weight" in checkpoint["model"]


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)
