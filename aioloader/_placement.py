"""Where a ``num_workers=0`` fetch runs for ``async for``: on the caller's loop while fetches
prove short and busy, else in the loader's fetch thread (issue 23).

A thread hop costs two thread wake-ups a batch (80-100 us on the 2-core machine), as much as
a whole batch of small samples. Torch's ``num_workers=0`` runs the fetch on the caller's
thread; so do we, for fetches that have shown they cannot hold the loop for long: each of
the last ``proof`` counted fetches in the thread took at most ``4 * limit`` (``cold``), did
not wait, and the caller's loop stayed idle meanwhile. A fetch *waited* when its thread gave
up its core of its own accord (a voluntary context switch: a sleep, a read, a lock) and its
CPU time fell under ``busy`` of its wall time; it starts the proof again, and stays in the
thread, where waiting is harmless. A fetch while which the loop's thread ran (its CPU clock,
read from the fetch's thread, moved more than ``LOOP_RAN``) is not counted either way: it
may have waited for the loop (a future of the caller's), which would hang the loop if it
ran there. The loop's clock sees that wait where the fetch's own counters can miss it: the
waking loop may preempt the fetch's thread and answer before that thread blocks (no
voluntary switch: the 2-core machine under load), and a busy fetch may wait for the loop
once among much work (a ratio over ``busy``). Judged by its own counters alone, such a
fetch moved onto the loop and hung it, once in the 1,380 tests of a clean-clone CI. A fetch
that overlaps the loop's other work (a ticker) is not counted either: it would hold that
work up there. Any wait for the loop shows on its clock, since the loop must run to answer
it; what the proof cannot see is a wait that the proving fetches did not make (a dataset
that waits for the loop only on a cache miss). A ``timeout`` keeps every fetch in the
thread (``_local``).

The thread's times only bound the loop's: there torch runs on one OpenMP thread, not the
caller's team, and a batch's first buffers fault their pages in on one core (a 9.6 MB image
batch: 4.4-6 ms, against 0.3-0.5 ms once its memory is reused, ``_recycle``).

On the loop, a fetch that waited past ``limit`` sends the fetches back to the thread at
once. Busy fetches are judged by their typical time, not one by one: a moving average
(weight ``1/8``, each fetch counted at most ``2 * limit``) over ``limit`` sends them back,
and so do two in a row past ``cold`` (the first ``WARM_UP`` there, whose memory is cold, are
judged by that alone). A busy fetch's time spreads with the machine's load (an image batch
of 1.1-1.9 ms in a fresh process on the 2-core machine), and going back is dear (a thread
hop a batch, and a proof four times as long): judged one by one against the bound, such
batches went back in half the runs of ``aioloader bench``: 11-13 of 80 batches in the
thread, against 3-5 for the proof alone. The next proof is four times as long (up to
``MAX_PROOF``), and each run of ``proof`` fetches on the loop halves it again (down to
``PROOF``). So the loop waits for a fetch about ``limit`` at most, typically: a dataset
whose fetches grow past it for good sends them back within 4-9 fetches (at once if they
wait), one whose samples are sometimes slow does that less and less often, and a machine's
passing load costs a short proof. A fetch that raises proves nothing.
"""

from __future__ import annotations

import functools
import resource
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

LIMIT = 0.002  # s: the longest a fetch on the loop may take
BUSY = 0.75  # CPU over wall time: below this a fetch waited for something
PROOF = 2  # fetches in a row, in the thread, before one runs on the loop
WARM_UP = 4  # the first fetches on the loop after a move are judged as the proof's
MAX_PROOF = 2048
SMOOTH = 1 / 8  # the weight of a fetch in the moving average of those on the loop
# The loop's CPU while a fetch ran in the thread, past which the loop did something: an idle
# loop's thread ran 0-3.5 us (uvloop's: up to 10), a round trip to it took 18-45 us of it.
LOOP_RAN = 5e-6
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)  # Linux: waits counted
_CPU_CLOCK: Callable[[int], int] | None = getattr(time, "pthread_getcpuclockid", None)


@dataclass
class Placement:
    """The decision, as plain state: :meth:`saw` takes each fetch's times."""

    limit: float = LIMIT
    busy: float = BUSY
    proof: int = PROOF
    inline: bool = False  # the next fetch runs on the loop
    streak: int = 0  # in the thread: short, busy fetches in a row; on the loop: within bound
    returns: int = 0  # times a fetch on the loop sent the fetches back to the thread
    over: bool = False  # the last fetch on the loop was busy past ``cold``
    moved: int = 0  # fetches on the loop since the last move there
    typical: float = 0.0  # on the loop: the busy fetches' moving average (capped)

    @property
    def cold(self) -> float:
        """The bound where times say less: in the thread, and first on the loop."""
        return 4 * self.limit

    def saw(self, wall: float, cpu: float, *, on_loop: bool, waits: int | None = None,
            loop: float = 0.0) -> None:
        """A fetch took ``wall`` seconds, ``cpu`` of them on its thread's CPU; its thread
        waited ``waits`` times (None: not counted, so time off the CPU counts as waiting);
        in the thread, the loop's thread ran ``loop`` seconds meanwhile."""
        waited = cpu < self.busy * wall and waits != 0
        if on_loop:
            self._saw_on_loop(wall, waited)
            return
        # However short, a fetch that waited stays: it may wait on the caller's loop, which
        # it would hang there (a loop round trip takes 30-50 us).
        short = wall <= self.cold and not waited
        if short and loop > LOOP_RAN:
            return  # it may have waited for the loop unseen: no proof, no disproof
        self.streak = self.streak + 1 if short else 0
        if self.streak >= self.proof:
            self.inline, self.streak, self.moved = True, 0, 0
            self.typical = self.limit / 2

    def _saw_on_loop(self, wall: float, waited: bool) -> None:
        self.moved += 1
        warming = self.moved <= WARM_UP  # its memory and the caller's team may be cold
        far = wall > self.cold
        if waited:
            back = wall > (self.cold if warming else self.limit)
        else:
            # A collection, an epoch's first batch, a page-faulting allocation: one-offs,
            # let pass; two in a row are not.
            back = far and self.over
            if not warming:
                self.typical += (min(wall, 2 * self.limit) - self.typical) * SMOOTH
                back = back or self.typical > self.limit
        if back:
            self.inline, self.streak, self.over = False, 0, False
            self.returns += 1
            self.proof = min(self.proof * 4, MAX_PROOF)
            return
        self.over = far and not waited
        self.streak += 1
        if self.streak >= self.proof and self.proof > PROOF:
            self.proof, self.streak = max(self.proof // 2, PROOF), 0

    def failed(self) -> None:
        """A fetch raised: start the proof again (in the thread)."""
        self.inline, self.streak, self.over = False, 0, False


class Times(NamedTuple):
    """What :func:`timed` measured of one call."""

    wall: float  # seconds
    cpu: float  # seconds on its thread's CPU
    waits: int | None  # its thread's voluntary context switches (None: not counted)
    loop: float = 0.0  # seconds the watched loop's thread ran meanwhile (:func:`away`)


def timed(fn: Callable[..., T], *args: Any, quick: float = 0.0,
          watch: int | None = None) -> tuple[T, Times]:
    """``fn(*args)``, with its wall and thread CPU seconds and the times its thread waited;
    one within ``quick`` seconds is counted as busy, without reading the thread's counters
    again (on the loop, where such a fetch is let pass either way: 2.5 -> 1.45 us a call,
    of a 100 us `tiny` batch). ``watch``: the CPU clock of the loop's thread, for a call in
    another thread (:func:`away`).

    Waits are the thread's voluntary context switches (Linux): a sleep, a read, a lock, a
    future. CPU time short of the wall time says less: a thread that the machine's load
    took off its core (involuntary switches) lost that time without waiting for anything
    (on the 2-core machine, a fresh process's first image batch on the loop: 28.6 ms wall,
    17.8 ms CPU, 3 involuntary switches and no voluntary one).
    """
    # getrusage's CPU times move in scheduler ticks here (0.0 ms for a 1.5 ms fetch): the
    # thread's clock for those, getrusage for the switches.
    before = _voluntary_switches()
    loop = 0 if watch is None else _cpu_ns(watch)
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn(*args)
    wall = time.perf_counter() - wall
    if wall <= quick:
        return out, Times(wall, wall, 0)
    cpu = time.thread_time() - cpu
    if watch is not None:
        loop = _cpu_ns(watch) - loop
    after = _voluntary_switches()
    waits = None if before is None or after is None else after - before
    return out, Times(wall, cpu, waits, loop / 1e9)


def away() -> Callable[..., tuple[Any, Times]]:
    """:func:`timed` for a call to run in another thread while this thread's loop waits for
    it: it watches this thread's CPU clock (``Times.loop``). 0.5 us a call."""
    if _CPU_CLOCK is None:
        return timed
    return functools.partial(timed, watch=_CPU_CLOCK(threading.get_ident()))


def _cpu_ns(clock: int) -> int:
    """A thread's CPU clock; 0 once that thread has ended (EINVAL): a loop whose thread
    ended while a fetch ran (the caller's ``asyncio.run`` returned) waits for nothing."""
    try:
        return time.clock_gettime_ns(clock)
    except OSError:
        return 0


def _voluntary_switches() -> int | None:
    """This thread's voluntary context switches so far (None: not counted here)."""
    if _RUSAGE_THREAD is None:
        return None
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


async def place(placement: Placement, offload: Callable[..., Awaitable[Any]],
                fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` where ``placement`` says: here (on the loop) or through ``offload``."""
    on_loop = placement.inline
    try:
        if on_loop:
            out, times = timed(fn, *args, quick=placement.limit)
        else:
            out, times = await offload(away(), fn, *args)
    except BaseException:
        placement.failed()
        raise
    placement.saw(times.wall, times.cpu, on_loop=on_loop, waits=times.waits, loop=times.loop)
    return out
