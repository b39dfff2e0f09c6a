"""The parent's end of one process (or thread) worker: its socket, its ledger, its start."""

from __future__ import annotations

import collections
import os
import socket
from dataclasses import dataclass, field
from typing import TypeAlias

from ..plane import _wire as wire
from ..plane._dataplane import Ledger
from ._phases import WorkerState
from ._starting import Handle, Launch, close_parent


@dataclass(eq=False)
class Link:
    """The parent's end of one worker: socket, ledger, start (the pipe's EOF is its own)."""

    sock: socket.socket
    ledger: Ledger
    launch: Launch
    frames: wire.FrameReader = field(default_factory=wire.FrameReader)
    fds: collections.deque[int] = field(default_factory=collections.deque)
    outbox: bytearray = field(default_factory=bytearray)
    eof: bool = False

    @property
    def process(self) -> Handle:
        return self.launch.process

    @property
    def pid(self) -> int | None:
        return self.launch.process.pid

    def read(self) -> list[wire.Message] | None:
        """Messages completed by the socket's next bytes; None when none waits or at ``eof``."""
        while not self.eof:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 18, 4)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                data, fds = b"", []
            self.fds.extend(fds)
            if not data:
                self.eof = True
                return None
            return list(self.frames.feed(data))  # (a frame's start is a word too)
        return None

    def send(self, msg: wire.Message) -> bool:
        """Send ``msg`` as far as the socket takes it: True when the rest waits (:meth:`flush`)."""
        if self.eof or self.sock.fileno() < 0:
            return False
        frame = wire.encode(msg)
        if self.outbox:
            self.outbox += frame
            return False
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return False  # the worker is gone; its sentinel tells why
        self.outbox += frame[sent:]
        return bool(self.outbox)

    def flush(self) -> bool:
        """The socket is writable: send what waits; True once nothing does."""
        try:
            sent = self.sock.send(self.outbox)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            sent = len(self.outbox)
        del self.outbox[:sent]
        return not self.outbox

    def close(self) -> None:
        """EOF: the worker's signal to stop; fds received and not taken go too."""
        close_parent(self.sock)
        while self.fds:
            os.close(self.fds.popleft())


Worker: TypeAlias = WorkerState[Link]
