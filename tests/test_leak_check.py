"""The leak check judges what the test itself made, never the whole machine's /dev/shm
(issue 19: other programs' ``sem.mp-*`` semaphores failed four tests of a full run)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from multiprocessing import shared_memory

import pytest

from aioloader.testing import LeakError, leak_check

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _made_by_another_program(name: str) -> None:
    """A process outside this one's tree leaves a /dev/shm entry behind (setsid: as a
    stranger's would)."""
    code = f"open('/dev/shm/{name}', 'wb').close()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   start_new_session=True)


def test_another_programs_shm_entries_are_not_this_tests_leak() -> None:
    names = [f"sem.mp-{uuid.uuid4().hex[:8]}", f"psm_{uuid.uuid4().hex[:8]}"]
    try:
        with leak_check(deadline=1.0):
            for name in names:
                _made_by_another_program(name)
    finally:
        for name in names:
            os.unlink(f"/dev/shm/{name}")


def test_a_shared_memory_block_this_test_leaves_is_reported() -> None:
    block = None
    try:
        with pytest.raises(LeakError, match="/dev/shm entries left"), leak_check(deadline=0.5):
            block = shared_memory.SharedMemory(create=True, size=4096)
            block.close()  # closed, never unlinked: a leak
        assert block is not None
    finally:
        if block is not None:
            block.unlink()


def test_an_entry_this_process_holds_open_is_reported() -> None:
    name = f"aioloader-test-{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    fd = None
    try:
        with pytest.raises(LeakError, match=name), leak_check(deadline=0.5):
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    finally:
        if fd is not None:
            os.close(fd)
        os.unlink(path)


def test_an_unlinked_block_is_no_leak() -> None:
    with leak_check(deadline=1.0):
        block = shared_memory.SharedMemory(create=True, size=4096)
        block.close()
        block.unlink()
