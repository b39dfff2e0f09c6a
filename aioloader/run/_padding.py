"""Even ranks over a stream: a rank whose pass is over repeats its pass's first batches.

Under ``even_batches`` every rank must take part in every step (DDP's gradient all-reduce
waits for all of them), but a stream's length is known to nobody in advance. Before each
batch the ranks agree whether *any* of them still has one of its pass; a rank that has not
hands over a batch of its own pass again, as ``DistributedSampler`` pads an epoch and as a
cached reader's plan repeats its first batches (``_distributed.even_out``), until the last
rank's pass is done. So no rank skips the rest of its pass, and nothing is lost
(issue 33).

The repeats are the pass's first batches, read again from the pass's start by a session of
their own, and cycled: a pass's batches are a function of (seed, pass, shape), so they are
the same on a resumed run. At most :data:`KEPT` (or ``num_workers``, if more) are held, as
copies, while the rank pads.
"""

from __future__ import annotations

import asyncio
import copy
import warnings
from collections.abc import Callable
from dataclasses import replace

from .._config import LoaderConfig
from ..plans._distributed import maxima
from ..plans._position import StreamPosition
from ..plans._state import Cursor
from ..workers._steps import Delivered, PassDone, Step
from ._session import Producer, Session

KEPT = 2  # batches held for repeating, at least (num_workers, if more: a round of shards)


class Even:
    """A run's epochs over a stream under ``even_batches``: the epoch goes on while any
    rank has a batch of its pass, and a rank whose pass is over repeats its first batches;
    with ``drop_last``, it ends when the first rank's pass does (the rest is dropped).
    ``fresh``: a producer of the current pass from its start."""

    def __init__(self, config: LoaderConfig, fresh: Callable[[], Producer]) -> None:
        self._config = config
        self._fresh = fresh
        self.repeats: list[Delivered] | None = None  # this rank's pass is over, not the others'
        self._handed = 0  # repeats handed over
        self._stream: Callable[[], StreamPosition] | None = None  # the cursor's, while padding

    async def next(self, session: Session, cursor: Cursor) -> tuple[Delivered | None, bool]:
        """The next batch and whether it is a repeat; ``(None, False)`` at the epoch's end,
        the same step for every rank, once the session's pass end is read."""
        c = self._config
        timeout, drop, repeats = c.output.timeout, c.batching.drop_last, self.repeats
        step: Step = PassDone(False) if repeats is not None else await session.next(timeout)
        if repeats is None and isinstance(step, PassDone) and step.empty and not drop:
            repeats = await self._first()  # nothing of the pass came here: has it any batch?
        has = isinstance(step, Delivered)
        some, out, stuck = await asyncio.to_thread(
            maxima, c.topo, [has, not has, repeats is not None and not repeats])
        if some and not (stuck or (drop and out)):
            if isinstance(step, Delivered):
                return step, False
            if self.repeats is None:  # this rank's pass is over, not the others'
                self.repeats = repeats = repeats if repeats is not None else await self._first()
                self._handed = 0
                stream = self._stream = cursor.stream
                if stream is not None:  # a state taken now: this rank's pass is over
                    cursor.stream = lambda: replace(stream(), pending=())
            assert repeats, "a pass with batches has a first one"
            kept = repeats[self._handed % len(repeats)]
            self._handed += 1
            return Delivered(copy.deepcopy(kept.value), nbytes=kept.nbytes), True
        if stuck and some:
            warnings.warn(
                f"even_batches: a rank's pass over the stream gave it no batch at all (rank "
                f"{c.topo.rank} or another), so it has none to repeat while the others go on: "
                "the epoch ends for every rank, and the rest of the others' pass is not seen. "
                "Give every rank and worker some data (fewer workers, or more instances), or "
                "pass even_batches=False", stacklevel=5)
        while not isinstance(step, PassDone):  # the epoch ends here for every rank
            step = await session.next(timeout)
        if self.repeats is not None:
            cursor.stream, self.repeats = self._stream, None
        return None, False

    async def _first(self) -> list[Delivered]:
        """The pass's first batches, read from its start by a session of their own, and
        copied (the consumer owns the values it gets)."""
        session = Session(self._fresh())
        batches: list[Delivered] = []
        kept = max(self._config.workers.num_workers, KEPT)
        try:
            await session.start()
            session.attach()
            while len(batches) < kept:
                step = await session.next(self._config.output.timeout)
                if isinstance(step, PassDone):
                    break
                batches.append(Delivered(copy.deepcopy(step.value), nbytes=step.nbytes))
        finally:
            await session.aclose()
        return batches
