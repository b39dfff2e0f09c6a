"""Batch samplers, index plans and seed derivation; pure, no I/O."""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, overload

import torch

# ------------------------------------------------------------------------------- randomness

_default_rng = random.Random()
_rng: ContextVar[random.Random] = ContextVar("aioloader_rng")


def current_rng() -> random.Random:
    """The generator set by `use_rng` in this context, else a module-wide one."""
    return _rng.get(_default_rng)


@contextlib.contextmanager
def use_rng(rng: random.Random) -> Iterator[None]:
    """Make `current_rng()` return `rng` in this context (and tasks started from it).

    Examples:
        with use_rng(random.Random(derive_seed(seed, epoch))):
            batches = sampler.get_batch_indices(instances)
    """
    token = _rng.set(rng)
    try:
        yield
    finally:
        _rng.reset(token)


def derive_seed(base: int, *parts: int) -> int:
    """A 64-bit seed mixed from `base` and `parts`: stable across runs, platforms and processes.

    Examples:
        derive_seed(seed, epoch, rank, worker_id)  # an independent stream per worker
    """
    h = hashlib.blake2b(digest_size=8, person=b"aioloader.seed")
    for n in (base, *parts):
        raw = int(n).to_bytes((int(n).bit_length() + 8) // 8, "little", signed=True)
        h.update(len(raw).to_bytes(4, "little"))  # length prefix: (1, 23) != (12, 3)
        h.update(raw)
    return int.from_bytes(h.digest(), "little")


# ------------------------------------------------------------------------------- index plans


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    """How many batches `n` instances make."""
    return n // batch_size if drop_last else -(-n // batch_size)


def torch_generator(seed: int) -> torch.Generator:
    """A CPU `torch.Generator` seeded with `seed` (a `derive_seed` value: 0 <= seed < 2**64)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


class LazyPlan(Sequence[list[int]]):
    """A plan whose batches become lists only when asked for (``batch(i)``, ``0 <= i <
    len``); compares equal to the list of its batches."""

    @overload
    def __getitem__(self, i: int) -> list[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...
    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        if isinstance(i, slice):
            return [self.batch(k) for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"batch {i} of {len(self)}")
        return self.batch(i % len(self))

    def batch(self, i: int) -> list[int]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyPlan):
            other = list(other)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


class InOrder(LazyPlan):
    """``range(n)`` in batches, as torch's SequentialSampler gives it: O(1) to hold whatever
    ``n`` (an arange of a dataset whose len() is 2**40 would take 8 TB)."""

    def __init__(self, n: int, batch_size: int, drop_last: bool) -> None:
        self._n, self._batch_size = n, batch_size
        self._len = num_batches(n, batch_size, drop_last)

    def __len__(self) -> int:
        return self._len

    def batch(self, i: int) -> list[int]:
        start = i * self._batch_size
        return list(range(start, min(start + self._batch_size, self._n)))


class Batches(LazyPlan):
    """A 1-D index tensor seen as batches of ``batch_size``.

    An epoch of 2,000,000 indices as 62,500 Python lists costs ~100 ms to build and sets off
    a full garbage collection that holds the GIL for another ~250 ms (the event loop waits
    for it, issue 9); as a tensor the plan is O(1) to hold and O(batch) per batch.
    """

    _BLOCK = 1 << 14  # indices turned into Python ints at a time (one flat list, not lists)

    def __init__(self, order: torch.Tensor, batch_size: int, drop_last: bool) -> None:
        self._order = order
        self._batch_size = batch_size
        self._len = num_batches(order.numel(), batch_size, drop_last)
        self._per_block = max(1, self._BLOCK // batch_size)  # batches per block
        self._block = -1
        self._flat: list[int] = []

    def __len__(self) -> int:
        return self._len

    def head(self, k: int) -> torch.Tensor:
        """The indices of the first ``k`` batches, as one tensor."""
        return self._order[: k * self._batch_size]

    def batch(self, i: int) -> list[int]:
        block, k = divmod(i, self._per_block)
        if block != self._block:  # batch by batch, tolist() would cost ~10 us each
            size = self._per_block * self._batch_size
            self._flat = self._order[block * size:(block + 1) * size].tolist()
            self._block = block
        start = k * self._batch_size
        return self._flat[start:start + self._batch_size]


def index_batches(
    instances_or_n: Sequence[Any] | int,
    batch_size: int | None,
    *,
    drop_last: bool,
    shuffle: bool,
    rng: random.Random | torch.Generator,
    sampler: BatchSampler | None = None,
) -> list[list[int]]:
    """The index batches of a cached list (or of a dataset's length), as `Batcher` cuts one
    block: `sampler`'s, drawing from `rng` through `current_rng()`; else indices 0..n-1,
    shuffled when asked, cut into batches (drop_last drops a short last one).

    The shuffle is `torch.randperm` (a Python-list shuffle of 2M indices takes ~1 s); a
    `random.Random` given as `rng` seeds the torch generator with 64 of its bits.
    """
    if sampler is not None:
        assert not isinstance(instances_or_n, int), "a sampler needs the instances"
        assert isinstance(rng, random.Random), "a BatchSampler draws from a random.Random"
        with use_rng(rng):
            return [list(b) for b in sampler.get_batch_indices(instances_or_n)]
    assert batch_size is not None  # (the loader's options: a batch size or a batch sampler)
    n = instances_or_n if isinstance(instances_or_n, int) else len(instances_or_n)
    if not shuffle:
        return list(Batches(torch.arange(n), batch_size, drop_last))
    generator = rng if isinstance(rng, torch.Generator) else torch_generator(rng.getrandbits(64))
    return list(Batches(torch.randperm(n, generator=generator), batch_size, drop_last))


# ------------------------------------------------------------------------------- samplers


class BatchSampler:
    """Groups instances into batches of indices. Subclass it, or implement the same methods.

    Examples:
        class Pairs(BatchSampler):
            def get_batch_indices(self, instances):
                return [[i, i + 1] for i in range(0, len(instances) - 1, 2)]

            def get_num_batches(self, instances):
                return len(instances) // 2
    """

    def get_batch_indices(self, instances: Sequence[Any]) -> Iterable[list[int]]:
        """Batches of indices into `instances`; randomness from `current_rng()`."""
        raise NotImplementedError

    def get_num_batches(self, instances: Sequence[Any]) -> int:
        """How many batches `get_batch_indices(instances)` gives."""
        raise NotImplementedError

    def get_batch_size(self) -> int | None:
        """The batch size, when there is one."""
        return None


class BucketBatchSampler(BatchSampler):
    """Batches instances of similar length, so that padding is small; batch order is random.

    Lengths come from the fields named in `sorting_keys` (dict keys or attributes); each is
    scaled by a random factor in [1 - padding_noise, 1 + padding_noise] before sorting, so that
    equal lengths do not always land in the same batch. With `sorting_keys=None` the field with
    the longest value in the first instance is used.

    Examples:
        BucketBatchSampler(32, sorting_keys=["tokens"], padding_noise=0.1)
    """

    def __init__(
        self,
        batch_size: int,
        sorting_keys: Sequence[str] | None = None,
        padding_noise: float = 0.1,
        drop_last: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(sorting_keys, str):
            raise ValueError(
                f"sorting_keys must be a list of field names, not the str {sorting_keys!r}"
            )
        if sorting_keys is not None and not sorting_keys:
            raise ValueError("sorting_keys must name at least one field (or be None to guess)")
        if not isinstance(padding_noise, (int, float)) or not 0 <= padding_noise < math.inf:
            raise ValueError(f"padding_noise must be a finite number >= 0, got {padding_noise!r}")
        self.batch_size = batch_size
        self.sorting_keys = None if sorting_keys is None else list(sorting_keys)
        self.padding_noise = float(padding_noise)
        self.drop_last = drop_last
        # Guessed once, so that every chunk of a lazy stream sorts by the same field.
        self._guessed_keys: list[str] | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(batch_size={self.batch_size}, "
            f"sorting_keys={self.sorting_keys!r}, padding_noise={self.padding_noise}, "
            f"drop_last={self.drop_last})"
        )

    def get_batch_indices(self, instances: Sequence[Any]) -> list[list[int]]:
        if not instances:
            return []
        rng = current_rng()
        keys = self._keys(instances[0])
        noise = self.padding_noise

        def noisy(i: int) -> tuple[float | int, ...]:
            lengths = [_field_length(instances[i], key, i) for key in keys]
            if noise:
                return (*(n * rng.uniform(1 - noise, 1 + noise) for n in lengths), i)
            return (*lengths, i)

        order = sorted(range(len(instances)), key=noisy)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        rng.shuffle(batches)
        return batches

    def get_num_batches(self, instances: Sequence[Any]) -> int:
        return num_batches(len(instances), self.batch_size, self.drop_last)

    def get_batch_size(self) -> int:
        return self.batch_size

    def _keys(self, first: Any) -> list[str]:
        if self.sorting_keys is not None:
            return self.sorting_keys
        if self._guessed_keys is None:
            self._guessed_keys = [_guess_key(first)]
        return self._guessed_keys


def _field_names(instance: Any) -> list[str]:
    if isinstance(instance, Mapping):
        return [k for k in instance if isinstance(k, str)]
    if isinstance(instance, tuple) and hasattr(instance, "_fields"):
        return list(instance._fields)
    return list(getattr(instance, "__dict__", {}))


def _field(instance: Any, key: str, index: int) -> Any:
    try:
        return instance[key] if isinstance(instance, Mapping) else getattr(instance, key)
    except (KeyError, AttributeError):
        raise ValueError(
            f"BucketBatchSampler: instance {index} has no field {key!r} "
            f"(fields: {_field_names(instance)})"
        ) from None


def _length(value: Any) -> int | None:
    try:
        return len(value)  # a tensor's or an array's first dimension; TypeError for a 0-d one
    except TypeError:
        return None


def _field_length(instance: Any, key: str, index: int) -> int:
    value = _field(instance, key, index)
    n = _length(value)
    if n is None:
        raise ValueError(
            f"BucketBatchSampler: field {key!r} of instance {index} is a "
            f"{type(value).__name__}, which has no length to sort by"
        )
    return n


def _guess_key(instance: Any) -> str:
    best: tuple[int, str] | None = None
    for name in _field_names(instance):
        n = _length(_field(instance, name, 0))
        if n is not None and (best is None or n > best[0]):
            best = (n, name)
    if best is None:
        raise ValueError(
            "BucketBatchSampler: cannot guess sorting_keys: no field of the first instance has "
            f"a length (fields: {_field_names(instance)}); pass sorting_keys"
        )
    return best[1]
