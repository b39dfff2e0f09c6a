"""Run a command in a session of its own, with a hard deadline; nothing of it may outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from aioloader.testing import members

REPO = Path(__file__).resolve().parents[2]


class Expired(Exception):
    """The command ran past its deadline and was killed; ``output`` is what it printed."""

    def __init__(self, seconds: float, output: str) -> None:
        super().__init__(f"ran past {seconds:.0f} s; killed\n{output[-4000:]}")
        self.output = output


def run_python(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with this checkout first on sys.path, stdout and stderr together.

    On expiry the whole session is killed and :class:`Expired` raised. Afterwards, whatever
    is left of the session gets 10 s to go, is killed, and fails an assertion.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise Expired(timeout, output) from None
    finally:
        deadline = time.monotonic() + 10
        while (left := members(session=proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)  # processes we did not start and cannot wait on: look again
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of {args} outlived it: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")
