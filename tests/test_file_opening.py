"""A file opened off the loop (``readers._files.open_read_only``, used by every local read of
the file readers and the shard readers) is never left open by a caller that gave up on it:
not when the thread finishes the open after the loop that waited for it is closed (a loader
closed while its next shard was opening ahead)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from aioloader.readers._files import open_read_only


def fds() -> set[str]:
    return {f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}" for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


def test_an_open_cancelled_and_finished_after_its_loop_closed_leaves_no_fd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: the thread waits
    entered = threading.Event()
    real_open = os.open

    def opening(path: Any, flags: int, *args: Any) -> int:
        if str(path) == str(fifo):
            entered.set()
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", opening)
    before = fds()
    threads = concurrent.futures.ThreadPoolExecutor(2)
    loop = asyncio.new_event_loop()
    loop.set_default_executor(threads)
    try:
        async def give_up() -> None:
            task = asyncio.ensure_future(open_read_only(str(fifo)))
            assert await asyncio.to_thread(entered.wait, 60)  # the open is in its thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        loop.run_until_complete(give_up())
    finally:
        loop.close()  # no loop is left to run a callback when the thread's open returns
    writer = os.open(fifo, os.O_WRONLY)  # the thread's open returns now
    threads.shutdown(wait=True)
    os.close(writer)
    assert fds() == before


def test_an_open_that_fails_says_why_and_leaves_no_fd(tmp_path: Path) -> None:
    before = fds()
    with pytest.raises(FileNotFoundError, match="missing"):
        asyncio.run(open_read_only(str(tmp_path / "missing")))
    assert fds() == before


def test_an_open_hands_over_its_fd(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"abc")
    fd = asyncio.run(open_read_only(str(path)))
    try:
        assert os.pread(fd, 3, 0) == b"abc"
    finally:
        os.close(fd)
