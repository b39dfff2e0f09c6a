"""Where a ``num_workers=0`` fetch runs for ``async for``: on the caller's loop while fetches
prove short and busy, else in the loader's fetch thread (issue 23).

A thread hop costs two thread wake-ups a batch (80-100 us on the 2-core machine), as much as
a whole batch of small samples. Torch's ``num_workers=0`` runs the fetch on the caller's
thread; so do we, for fetches that have shown they cannot hold the loop for long: each of
the last ``proof`` fetches in the thread was busy for at least ``busy`` of its wall time
(its thread's CPU time over its wall time) and took at most ``4 * limit`` (``cold``). The
thread's times only bound the loop's: there torch runs on one OpenMP thread, not the
caller's team, and a batch's first buffers fault their pages in on one core (a 9.6 MB image
batch: 4.4-6 ms, against 0.3-0.5 ms once its memory is reused, ``_recycle``). A fetch
that waits on anything (a sleep, a file, a lock, a future of the caller's loop) is idle for
most of its wall time, so it stays in the thread, where waiting is harmless.

On the loop, a fetch that takes longer than ``limit`` (the first ``WARM_UP`` there, whose
memory is cold, ``cold``) sends the fetches back to the thread if it waited, or if the one
before it was past the bound too (a busy one-off, a collection or a cold allocation, is let
pass: going back is dear); the next proof is four times as long (up to ``MAX_PROOF``), and
each run of ``proof`` fetches on the loop halves it again (down to ``PROOF``). So the loop
waits at most ``limit`` for a fetch, but for the one or two that send them back; a dataset
whose samples are sometimes slow does that less and less often, and a machine's passing
load costs a short proof. A fetch that raises proves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

LIMIT = 0.002  # s: the longest a fetch on the loop may take
BUSY = 0.75  # CPU over wall time: below this a fetch waited for something
PROOF = 2  # fetches in a row, in the thread, before one runs on the loop
WARM_UP = 4  # the first fetches on the loop after a move are judged as the proof's
MAX_PROOF = 2048
TINY = 50e-6  # s: a fetch this short is short and busy (its CPU time is mostly clock noise)


@dataclass
class Placement:
    """The decision, as plain state: :meth:`saw` takes each fetch's times."""

    limit: float = LIMIT
    busy: float = BUSY
    proof: int = PROOF
    inline: bool = False  # the next fetch runs on the loop
    streak: int = 0  # in the thread: short, busy fetches in a row; on the loop: within bound
    returns: int = 0  # times a fetch on the loop sent the fetches back to the thread
    over: bool = False  # the last fetch on the loop was busy past the bound
    moved: int = 0  # fetches on the loop since the last move there

    @property
    def cold(self) -> float:
        """The bound where times say less: in the thread, and first on the loop."""
        return 4 * self.limit

    def saw(self, wall: float, cpu: float, *, on_loop: bool) -> None:
        """A fetch took ``wall`` seconds, ``cpu`` of them on its thread's CPU."""
        if on_loop:
            self.moved += 1
            warming = self.moved <= WARM_UP  # its memory and the caller's team may be cold
            over = wall > (self.cold if warming else self.limit)
            # Past the bound: at once if it waited (a read, a sleep: what the thread is
            # for); if it was busy, on the second in a row (a collection, an epoch's first
            # batch, a page-faulting allocation are one-offs, and going back is dear: it
            # costs a thread hop a batch and a proof four times as long).
            if over and (cpu < self.busy * wall or self.over):
                self.inline, self.streak, self.over = False, 0, False
                self.returns += 1
                self.proof = min(self.proof * 4, MAX_PROOF)
                return
            self.over = over
            self.streak += 1
            if self.streak >= self.proof and self.proof > PROOF:
                self.proof, self.streak = max(self.proof // 2, PROOF), 0
            return
        # A fetch of a few clock reads cannot have waited for long, whatever its ratio says.
        short = wall <= TINY or (wall <= self.cold and cpu >= self.busy * wall)
        self.streak = self.streak + 1 if short else 0
        if self.streak >= self.proof:
            self.inline, self.streak, self.moved = True, 0, 0

    def failed(self) -> None:
        """A fetch raised: start the proof again (in the thread)."""
        self.inline, self.streak, self.over = False, 0, False


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float, float]:
    """``fn(*args)`` with its wall and thread CPU seconds."""
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.thread_time() - cpu


async def place(placement: Placement, offload: Callable[..., Awaitable[Any]],
                fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` where ``placement`` says: here (on the loop) or through ``offload``."""
    on_loop = placement.inline
    try:
        if on_loop:
            out, wall, cpu = timed(fn, *args)
        else:
            out, wall, cpu = await offload(timed, fn, *args)
    except BaseException:
        placement.failed()
        raise
    placement.saw(wall, cpu, on_loop=on_loop)
    return out
