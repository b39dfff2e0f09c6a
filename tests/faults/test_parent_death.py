"""Cases 3, 4 (Ctrl-C) and 5: the main process is killed or interrupted; a tiny /dev/shm.

Each victim is a script in ``scripts/``, run in its own session (start_new_session) so
that signals reach it alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from fault_helpers import (
    SCRIPTS,
    ended,
    finish,
    kill_9,
    read_line,
    script_env,
    start_script,
    survivors,
)

from aioloader.testing import _shm, descendants, describe_pids

GONE_BOUND = 10.0  # the issue asks for 3 s (the contract: 15 s); CI gets slack


@pytest.mark.leaks_ok  # the whole tree of the victim is checked here, helpers included
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "cached"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_kill_9_main_process(method: str, lazy: bool) -> None:
    if lazy is False and method != "fork":
        pytest.skip("cached mode: the fork cell is enough (spawn costs seconds per worker)")
    shm_before = _shm()
    with ended(start_script("kill_target.py", method, "1" if lazy else "0")) as proc:
        info = read_line(proc, timeout=45)
        assert info["pid"] == proc.pid
        tree = descendants(proc.pid)  # walked from /proc/*/stat just before the kill
        names = describe_pids(tree)
        assert len(tree) >= 2, names
        left, gone_s = kill_9(proc, tree, GONE_BOUND)
    print(f"\nLATENCY kill -9 {method} {'lazy' if lazy else 'cached'}: {len(tree)} "
          f"descendants ({names}) gone {gone_s:.2f}s after the kill")
    if left:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still alive {GONE_BOUND}s after kill -9: {describe_pids(left)}"
    # Only what the victim's tree made: a name with one of its pids (torch's torch_<pid>_*),
    # never another program's semaphores (issue 19).
    marks = [f"_{pid}_" for pid in (proc.pid, *tree)]
    left_shm = {name for name in _shm() - shm_before if any(m in name for m in marks)}
    assert not left_shm, f"/dev/shm entries left by the killed tree: {sorted(left_shm)}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_mid_epoch(mode: str) -> None:
    # No race with the epoch: the victim reports on its stdout pipe once a batch arrived,
    # and its first epoch cannot end before the SIGINT (its workers stall; see the script).
    proc = start_script("sigint_target.py", mode)
    info = read_line(proc, timeout=45)
    assert info.get("workers"), info
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc, timeout=45)
    took = time.monotonic() - t0
    assert rc == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    print(f"\nLATENCY ctrl-c {mode}: SIGINT to script end (stop + a full epoch) {took:.2f}s: "
          f"{result}")
    assert result.get("ok") is True, (result, err[-2000:])
    assert result["alive_after_interrupt"] == []
    assert not survivors(5.0, pids=info["workers"])


def _unshare_works() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.leaks_ok  # torch's workers in there are torch's business; checked below
@pytest.mark.deadline(150)
def test_small_dev_shm() -> None:
    if not _unshare_works():
        pytest.skip("unshare --mount / mount tmpfs not permitted here")
    script = os.path.join(SCRIPTS, "small_shm.py")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=script_env(), start_new_session=True)
    rc, out, err = finish(proc, timeout=130)
    lines = out.strip().splitlines()
    assert lines, f"rc={rc}\n{err[-3000:]}"
    result = json.loads(lines[-1])
    print(f"\nRESULT small /dev/shm: {json.dumps(result)}")
    assert result["shm_mb"] == 64
    assert result["aioloader"]["ok"] is True, result
    # torch's outcome is reported, not asserted: it depends on its sharing strategy.
    assert "torch" in result, f"the torch half did not report (rc={rc}):\n{err[-3000:]}"
    assert not survivors(15.0, root=proc.pid)
