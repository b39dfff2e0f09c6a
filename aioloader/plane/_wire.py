"""The messages between the supervisor and its workers: typed, tagged, msgpack-framed data.

Every message is a frozen dataclass with a fixed tag (1-9: parent -> worker; 10 on: worker ->
parent). On the wire a message is a 4-byte big-endian length followed by the msgpack array
``[tag, *fields]``. There are no in-band sentinels: the end of a pass, a failure and an arena
change are messages of their own (docs/architecture.md, "The wire", says what each means).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import msgpack

from .._errors import FrameTooLargeError

_LEN = struct.Struct("!I")
MAX_FRAME = 1 << 31  # bytes in one message body; the 4-byte length could say up to 4 GiB


@dataclass(frozen=True, slots=True)
class Release:
    """The parent copied slot ``slot`` out: the worker may reuse it."""

    TAG: ClassVar[int] = 1
    slot: int


@dataclass(frozen=True, slots=True)
class Task:
    """Fetch ``indices`` from the map-style source and collate them as batch ``seq``."""

    TAG: ClassVar[int] = 2
    seq: int
    indices: list[int]


@dataclass(frozen=True, slots=True)
class Rewind:
    """Drop the pass under way and read pass ``pass_no`` from its start (persistent
    workers, a stream's epoch left early): say :class:`Rewound`, then stream that pass."""

    TAG: ClassVar[int] = 3
    pass_no: int


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch lies in arena slot ``slot``; ``tree``: its structure (_codec); ``nbytes``:
    its tensor data (what copying it out costs); ``mark``: where a stream's batch lies in
    its pass (``_position.Mark``); ``busy``: the worker's seconds at work so far."""

    TAG: ClassVar[int] = 10
    slot: int
    seq: int
    nbytes: int
    tree: Any
    mark: Any = None
    busy: float = 0.0


@dataclass(frozen=True, slots=True)
class PassEnd:
    """The worker finished pass ``pass_no`` of its shard after ``batches`` batches. It holds
    a slot, so that a worker with an empty shard cannot run ahead without bound."""

    TAG: ClassVar[int] = 11
    slot: int
    pass_no: int
    batches: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The worker raised; it exits after sending this."""

    TAG: ClassVar[int] = 12
    error_repr: str
    traceback: str
    pickled: bytes | None


@dataclass(frozen=True, slots=True)
class BatchFailed:
    """Making batch ``seq`` raised; the worker goes on, as torch's does: the error is that
    batch's, raised in its turn. A stream's failed batch holds ``slot`` and its ``mark`` as
    its batch would have (a source that raises on every instance runs no further ahead than
    one that yields); an index batch's has neither (its task bounds it).
    """

    TAG: ClassVar[int] = 17
    seq: int
    error_repr: str
    traceback: str
    pickled: bytes | None
    slot: int | None = None
    mark: Any = None


@dataclass(frozen=True, slots=True)
class Rewound:
    """The worker dropped its pass for :class:`Rewind`: what it sent before this belongs to
    the pass dropped, what follows to pass ``pass_no``, from its start."""

    TAG: ClassVar[int] = 18
    pass_no: int


@dataclass(frozen=True, slots=True)
class Arena:
    """The worker's arena is now the file descriptor passed with this message."""

    TAG: ClassVar[int] = 13
    slots: int
    slot_size: int


@dataclass(frozen=True, slots=True)
class Progress:
    """The worker is still reading, no batch full yet: not silence, for the timeout."""

    TAG: ClassVar[int] = 14


@dataclass(frozen=True, slots=True)
class Retiring:
    """The worker is due for recycling: a successor takes over its stream at ``position``
    (``ShardPosition.to_data()``), or, for index batches (None), the tasks not yet sent."""

    TAG: ClassVar[int] = 15
    position: Any


@dataclass(frozen=True, slots=True)
class Skipped:
    """With ``on_error="skip"``, the load of ``key`` (itself when plain data, else its
    repr) failed ``attempts`` times; ``error``: the last error's repr."""

    TAG: ClassVar[int] = 16
    key: Any
    attempts: int
    error: str


Message = (Release | Task | Rewind | Batch | PassEnd | Failed | BatchFailed | Rewound | Arena
           | Progress | Retiring | Skipped)
_TYPES: dict[int, type[Any]] = {cls.TAG: cls for cls in get_args(Message)}


def encode(msg: Message) -> bytes:
    """One framed message; FrameTooLargeError if its body would exceed ``MAX_FRAME``."""
    # Not dataclasses.astuple: it deep-copies, and this runs once per batch.
    fields = [getattr(msg, name) for name in msg.__slots__]
    try:
        body: bytes = msgpack.packb([msg.TAG, *fields], use_bin_type=True)
    except UnicodeEncodeError:
        if not isinstance(msg, Failed):
            raise
        # An error's text may hold surrogate escapes (an undecodable file name in its
        # message); it is there to be read, so escape them rather than lose the report.
        body = msgpack.packb([msg.TAG, _readable(msg.error_repr),
                              _readable(msg.traceback), msg.pickled], use_bin_type=True)
    except ValueError as exc:  # msgpack: "bytes is too large", a value of 4 GiB or more
        if "too large" not in str(exc).lower():
            raise
        raise FrameTooLargeError(_too_large(msg, None)) from exc
    if len(body) > MAX_FRAME:
        raise FrameTooLargeError(_too_large(msg, len(body)))
    return _LEN.pack(len(body)) + body


def _readable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _too_large(msg: Message, size: int | None) -> str:
    took = f"takes {size} bytes" if size is not None else "holds a value of 4 GiB or more"
    if isinstance(msg, Batch):
        return (f"batch {msg.seq} cannot be sent: its message {took}, over the limit of "
                f"{MAX_FRAME} bytes. A batch's non-tensor values (strings, lists, numbers, "
                f"pickled objects) travel in that message; put large data in tensors, which "
                f"travel through shared memory")
    return f"a {type(msg).__name__} message {took}, over the limit of {MAX_FRAME} bytes"


def decode(body: bytes | memoryview) -> Message:
    """The message in one frame body (the bytes after the length)."""
    tag, *fields = msgpack.unpackb(body, raw=False, strict_map_key=False)
    try:
        cls = _TYPES[tag]
    except KeyError:
        raise ValueError(f"unknown message tag {tag!r}") from None
    msg: Message = cls(*fields)
    return msg


class FrameReader:
    """Cuts a byte stream into messages; feed it whatever ``recv`` returned."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """The messages completed by ``data``; FrameTooLargeError on a corrupt length."""
        self._buf += data
        out: list[Message] = []
        view = memoryview(self._buf)
        pos = 0
        try:
            while len(view) - pos >= _LEN.size:
                (size,) = _LEN.unpack_from(view, pos)
                if size > MAX_FRAME:  # no writer sends that: waiting for it would never end
                    raise FrameTooLargeError(
                        f"a frame says it holds {size} bytes, over the limit of {MAX_FRAME}: "
                        f"the stream is corrupt or out of step, and cannot be read further")
                end = pos + _LEN.size + size
                if end > len(view):
                    break
                out.append(decode(view[pos + _LEN.size:end]))
                pos = end
        finally:
            view.release()
        if pos:
            del self._buf[:pos]
        return out
