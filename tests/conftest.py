"""Every test: a deadline, and a leak check afterwards.

* SIGALRM fails a test that runs past its deadline (default 60 s,
  ``@pytest.mark.deadline(s)``); faulthandler dumps every thread and ends the run 60 s later
  if even that does not get through;
* an autouse fixture fails a test whose child processes, fds or own /dev/shm entries outlive
  it by more than 10 s (``aioloader.testing.leak_check``), and kills those processes so the
  next test starts clean. ``@pytest.mark.leaks_ok`` skips it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterator

import pytest

from aioloader.testing import leak_check, warm_up

DEFAULT_DEADLINE = float(os.environ.get("TESTS_DEADLINE", "120"))
HARD_EXTRA = 60.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "leaks_ok: skip the after-test leak check")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    marker = item.get_closest_marker("deadline")
    seconds = float(marker.args[0]) if marker else DEFAULT_DEADLINE

    def on_alarm(signum: int, frame: object) -> None:
        pytest.fail(f"deadline: {item.nodeid} ran past {seconds:.0f}s (hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + HARD_EXTRA, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True, scope="session")
def _warm_up() -> None:
    warm_up()  # uvloop's process-wide signal pipe, before any baseline


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("leaks_ok"):
        yield
        return
    with leak_check(deadline=10.0):
        yield
