"""What a producer hands its session: a delivered batch, a pass's end, and a sign of life.

The producers (this layer) make these; the session (aioloader/run) consumes them. They live
here so that the arrow points down: a producer never imports the session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Delivered:
    """A batch (or a chunk of instances), the consumer's own; ``seq`` and ``mark`` (where a
    stream's batch lies in its pass) as the worker sent them."""

    value: Any
    seq: int = -1
    mark: Any = None
    nbytes: int = 0  # tensor bytes (telemetry)


@dataclass(frozen=True, slots=True)
class PassDone:
    """The end of one pass over the data; ``empty``: the whole pass produced nothing."""

    empty: bool


Step = Delivered | PassDone


class Activity:
    """When a producer last showed a sign of life; written from any thread."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def touch(self) -> None:
        self.at = time.monotonic()

    def __call__(self) -> float:
        return self.at
