"""This process's shard of one pass over a stream, read from a block start: the loader's
sharding, the source's own state there, and what an earlier shape delivered left out."""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._position import PASS_START, BlockStart
from ._sources import Kind, aclose, is_stateful, open_pass, shard_spec, unhooked


@dataclass(frozen=True, slots=True)
class Raised:
    """The source's iterator raised ``error`` where an instance was due, and was asked for
    the next one all the same (:class:`Shard`'s ``errors_go_on``). It takes an instance's
    raw position: read again, a deterministic source raises there again."""

    error: Exception


class Shard:
    """This process's shard of one pass over a streaming source, from a block start on.

    The loader's sharding keeps raw positions ``index, index + count, ...``, so positions
    are arithmetic and only the source's own state is asked for, at block starts.
    ``errors_go_on``: a (sync) iterator's exception comes as a :class:`Raised` item and the
    iterator is asked again, as torch's IterableDataset worker does (issue 32; a generator
    that raised is over, and so is the pass).
    """

    def __init__(self, source: Any, kind: Kind, data_path: Any, worker: int,
                 num_workers: int, rank: int, world_size: int,
                 start: BlockStart = PASS_START, *, keys: bool = False,
                 delivered: Callable[[int], bool] | None = None,
                 numbered: tuple[int, ...] | None = None, errors_go_on: bool = False) -> None:
        self.index, self.count = shard_spec(source, kind, worker, num_workers, rank,
                                            world_size)
        # A stream of keys (a load stage follows) runs ahead of the instances loaded: the
        # source's own state would be ahead too. Keys are cheap to skip; raw counts suffice.
        self._stateful = source if is_stateful(source) and not keys else None
        self.base = start.raw
        self.first = self.base + (self.index - self.base) % self.count  # first raw kept
        skip = self.base
        if start.state is not None:
            if self._stateful is None:
                raise ValueError(f"the state holds a position of {type(source).__name__}'s "
                                 "own, but it has no load_state_dict()")
            self._stateful.load_state_dict(start.state)
            skip = 0  # (else the instances before the start are read again and dropped)
        opened = open_pass(source, kind, data_path, worker, num_workers, rank, world_size)
        if errors_go_on and isinstance(opened, Iterator):  # (an IterableDataset's iter())
            opened = _going_on(opened)
        self.stream = _from(opened, skip + self.first - self.base, self.count)
        self._kept: Kept | None = None
        if delivered is not None:  # the pass was resumed on another shape: skip its past
            self._kept = Kept(self.first, self.count, delivered, track=numbered is None)
            self.stream = _picked(self.stream, self._kept.pick)
        self.numbered = numbered is not None
        if numbered is not None:  # (number, key) pairs; the keys delivered are left out
            self.stream = _numbered(self.stream, numbered[0], frozenset(numbered[1:]))

    def mark(self, block: int, taken: int) -> BlockStart:
        """The start of block ``block``, which follows the ``taken``-th instance taken."""
        if self.numbered:  # a position in numbered keys has no use for block starts
            return BlockStart(block, self.base, None)
        if self._kept is not None:
            raw = self._kept.after(taken) if taken else self.base
        else:
            raw = self.first + (taken - 1) * self.count + 1 if taken else self.base
        state = None
        if self._stateful is not None:
            state = self._stateful.state_dict()
            _check_json(state, self._stateful)
        return BlockStart(block, raw, state)


class Kept:
    """A shard's stream past a :class:`Frontier`: the instances an earlier shape delivered
    are dropped, and the raw position of each one kept is remembered until the block it
    ends is marked (at most a block, and the load stage's window, are held)."""

    def __init__(self, first: int, count: int, delivered: Callable[[int], bool], *,
                 track: bool = True) -> None:
        self._next = first  # the raw position of the next item the stream yields
        self._count = count
        self._delivered = delivered
        self._track = track  # remember the raw positions kept (for block starts)
        self._raws: collections.deque[int] = collections.deque()
        self._marked = 0
        self._last = -1

    def pick(self, n: int, item: Any) -> Any:
        """The n-th item of the shard's stream, or ``DROP``: an earlier shape delivered it."""
        raw, self._next = self._next, self._next + self._count
        if self._delivered(raw):
            return DROP
        if self._track:
            self._raws.append(raw)
        return item

    def after(self, taken: int) -> int:
        """The raw position just after the ``taken``-th instance kept."""
        while self._marked < taken:
            self._last = self._raws.popleft()
            self._marked += 1
        return self._last + 1


DROP = object()  # what a pick returns for an item left out


def _going_on(it: Iterator[Any]) -> Iterator[Any]:
    """``it``'s items, an exception it raises as a :class:`Raised` item: it is asked for
    the next one all the same, until it stops."""
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - that instance's error, passed on as data
            yield Raised(exc)
            continue
        yield item


def _picked(stream: Iterable[Any] | AsyncIterable[Any], pick: Callable[[int, Any], Any]
            ) -> Iterable[Any] | AsyncIterable[Any]:
    """What ``pick(n, item)`` makes of the n-th item of ``stream``, sync or async alike, but
    for the items it leaves out (``DROP``)."""
    if isinstance(stream, AsyncIterable):
        return _apicked(stream, pick)
    picked = itertools.starmap(pick, enumerate(stream))
    return (out for out in picked if out is not DROP)


async def _apicked(stream: AsyncIterable[Any], pick: Callable[[int, Any], Any]
                   ) -> AsyncIterator[Any]:
    # Every async iterator here wraps the source's: started unhooked (as the pipeline starts
    # the outer one, see _pipeline) and closed with it, so no loop's shutdown finalizes the
    # source under a producer that outlives that loop.
    inner = unhooked(stream)
    n = 0
    try:
        async for item in inner:
            out = pick(n, item)
            n += 1
            if out is not DROP:
                yield out
    finally:
        await aclose(inner)


def _numbered(stream: Iterable[Any] | AsyncIterable[Any], low: int,
              done: frozenset[int]) -> Iterable[Any] | AsyncIterable[Any]:
    """``(n, item)`` for the n-th item of ``stream``, but for those before ``low`` or in
    ``done`` (delivered before a resume)."""
    return _picked(stream, lambda n, item: (n, item) if n >= low and n not in done else DROP)


def _from(stream: Iterable[Any] | AsyncIterable[Any], first: int,
          step: int) -> Iterable[Any] | AsyncIterable[Any]:
    """Items ``first, first + step, ...`` of ``stream`` (the stream itself when (0, 1))."""
    if first == 0 and step == 1:
        return stream
    if not isinstance(stream, AsyncIterable):
        return itertools.islice(stream, first, None, step)
    return _picked(stream, lambda n, item: item if n >= first and (n - first) % step == 0
                   else DROP)


def _check_json(state: Any, source: Any) -> None:
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{type(source).__name__}.state_dict() returned {state!r}, which is "
                        f"not JSON data ({exc}): a reader's state must be plain dicts, "
                        "lists, strings and numbers, so that it fits in a checkpoint") from exc
