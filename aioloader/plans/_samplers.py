"""Batch samplers, batching of instance streams and seed derivation; pure, no I/O."""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar, overload

import numpy as np
import torch

__all__ = [
    "BatchSampler",
    "Batcher",
    "BucketBatchSampler",
    "Group",
    "current_rng",
    "derive_seed",
    "index_batches",
    "num_batches",
    "plan_indices",
    "split_batches",
    "torch_generator",
    "use_rng",
]

T = TypeVar("T")

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
        if not isinstance(n, int):
            raise TypeError(f"derive_seed takes ints, not {type(n).__name__} ({n!r})")
        raw = int(n).to_bytes((int(n).bit_length() + 8) // 8, "little", signed=True)
        h.update(len(raw).to_bytes(4, "little"))  # length prefix: (1, 23) != (12, 3)
        h.update(raw)
    return int.from_bytes(h.digest(), "little")


# ------------------------------------------------------------------------------- index plans


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    """How many batches `n` instances make."""
    _check_batch_size(batch_size)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return n // batch_size if drop_last else -(-n // batch_size)




def torch_generator(seed: int) -> torch.Generator:
    """A CPU `torch.Generator` seeded with `seed` (a `derive_seed` value: 0 <= seed < 2**64)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


class Batches(Sequence[list[int]]):
    """A 1-D index tensor seen as batches of ``batch_size``: each batch becomes a list only
    when it is asked for.

    An epoch of 2,000,000 indices as 62,500 Python lists costs ~100 ms to build and sets off
    a full garbage collection that holds the GIL for another ~250 ms (the event loop waits
    for it, issue 9); as a tensor the plan is O(1) to hold and O(batch) per batch. Compares
    equal to the list of its batches.
    """

    _BLOCK = 1 << 14  # indices turned into Python ints at a time (one flat list, not lists)

    def __init__(self, order: torch.Tensor, batch_size: int, drop_last: bool) -> None:
        _check_batch_size(batch_size)
        n = order.numel()
        self._order = order
        self._batch_size = batch_size
        self._len = n // batch_size if drop_last else -(-n // batch_size)
        self._per_block = max(1, self._BLOCK // batch_size)  # batches per block
        self._block = -1
        self._flat: list[int] = []

    def __len__(self) -> int:
        return self._len

    def head(self, k: int) -> torch.Tensor:
        """The indices of the first ``k`` batches, as one tensor."""
        return self._order[: k * self._batch_size]

    @overload
    def __getitem__(self, i: int) -> list[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...
    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"batch {i} of {self._len}")
        block, k = divmod(i, self._per_block)
        if block != self._block:  # batch by batch, tolist() would cost ~10 us each
            size = self._per_block * self._batch_size
            self._flat = self._order[block * size:(block + 1) * size].tolist()
            self._block = block
        start = k * self._batch_size
        return self._flat[start:start + self._batch_size]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Batches):
            other = list(other)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


def split_batches(order: torch.Tensor, batch_size: int, drop_last: bool) -> Batches:
    """A 1-D index tensor cut into batches of `batch_size`; drop_last drops a short last one."""
    return Batches(order, batch_size, drop_last)


def index_batches(
    n: int,
    batch_size: int,
    *,
    drop_last: bool,
    shuffle: bool,
    rng: random.Random | torch.Generator,
) -> list[list[int]]:
    """Indices 0..n-1, shuffled when asked, cut into batches; drop_last drops a short last one.

    The shuffle is `torch.randperm` (a Python-list shuffle of 2M indices takes ~1 s); a
    `random.Random` given as `rng` seeds the torch generator with 64 of its bits.
    """
    _check_batch_size(batch_size)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not shuffle:
        return list(split_batches(torch.arange(n), batch_size, drop_last))
    generator = rng if isinstance(rng, torch.Generator) else torch_generator(rng.getrandbits(64))
    return list(split_batches(torch.randperm(n, generator=generator), batch_size, drop_last))


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
        _check_batch_size(batch_size)
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
    if isinstance(value, torch.Tensor):
        return value.size(0) if value.dim() else None
    if isinstance(value, np.ndarray):
        return value.shape[0] if value.ndim else None
    try:
        return len(value)
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


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")


# ------------------------------------------------------------------------------- batching


def plan_indices(
    instances_or_len: Sequence[Any] | int,
    *,
    batch_size: int | None,
    drop_last: bool,
    shuffle: bool,
    sampler: BatchSampler | None,
    rng: random.Random,
) -> list[list[int]]:
    """Index batches for a cached list (or a map-style dataset's length); agrees with `Batcher`.

    Without a sampler the shuffle is `index_batches`' (torch.randperm seeded from `rng`); a
    sampler draws from `rng` through `current_rng()`.
    """
    check_options(batch_size, drop_last, shuffle, sampler)
    if sampler is not None:
        if isinstance(instances_or_len, int):
            raise TypeError("plan_indices: a sampler needs the instances, not their number")
        with use_rng(rng):
            return [list(b) for b in sampler.get_batch_indices(instances_or_len)]
    assert batch_size is not None  # check_options
    n = instances_or_len if isinstance(instances_or_len, int) else len(instances_or_len)
    return index_batches(n, batch_size, drop_last=drop_last, shuffle=shuffle, rng=rng)


class Group(NamedTuple):
    """One batch of instances, and where it lies in its pass: batch number ``batch`` of
    block ``block`` (see :class:`Batcher`)."""

    block: int
    batch: int
    items: list[Any]
    size: int | None = None  # the block's instances, when it was planned whole (not streamed)


class Batcher:
    """Turns a stream of instances into batches, push-style, for sync and async loops alike.

    The stream is cut into **blocks** of `chunk_size` instances (None: the whole pass is one
    block); without a sampler a block is rounded down to whole batches. A block is shuffled
    (or given to the sampler) with its own generator, seeded from (`seed`, block number), and
    batches never span two blocks except that, without shuffling or a sampler, they stream
    out as soon as they are full. So a pass can be resumed from the start of any block: its
    batches are a function of the block's instances and number alone (issue 10). At most
    `chunk_size` instances are held. After `finish()` it is ready for the next pass.

    `seed` None draws one from `current_rng()` at construction. `first_block` numbers the
    first block (a pass resumed at that block).

    Examples:
        batcher = Batcher(batch_size=2, drop_last=False, shuffle=True, sampler=None,
                          chunk_size=100, seed=7)
        for instance in stream:
            for group in batcher.feed(instance):
                yield group.items
        yield from (group.items for group in batcher.finish())
    """

    def __init__(
        self,
        *,
        batch_size: int | None,
        drop_last: bool,
        shuffle: bool,
        sampler: BatchSampler | None,
        chunk_size: int | None,
        seed: int | None = None,
        first_block: int = 0,
    ) -> None:
        check_options(batch_size, drop_last, shuffle, sampler)
        if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size < 1):
            raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._shuffle = shuffle
        self._sampler = sampler
        self._seed = current_rng().getrandbits(64) if seed is None else seed
        if chunk_size is None or sampler is not None:
            self._capacity = chunk_size
        else:
            assert batch_size is not None
            self._capacity = max(chunk_size // batch_size, 1) * batch_size
        self._stream = sampler is None and not shuffle  # batches go out as they fill
        self._first_block = first_block
        self.block = first_block  # the block the next instance goes into
        self.filled = 0  # instances in that block so far
        self._pending: list[Any] = []  # the block's instances (sampler or shuffle)
        self._batch: list[Any] = []  # the batch being filled (streaming)
        self._index = 0  # batches of the block given out (streaming)

    def feed(self, instance: Any) -> list[Group]:
        """Take one instance; return the batches it completes (often none)."""
        self.filled += 1
        if self._stream:
            self._batch.append(instance)
            out = [self._streamed()] if len(self._batch) == self._batch_size else []
        else:
            self._pending.append(instance)
            out = self._close_block() if self.filled == self._capacity else []
        if self.filled == self._capacity:
            self._next_block()
        return out

    def finish(self) -> list[Group]:
        """The remaining batches of this pass; resets for the next one."""
        if self._stream:
            out = [self._streamed()] if self._batch and not self._drop_last else []
        else:
            out = self._close_block(last=True) if self._pending else []
        self._batch, self._pending = [], []
        self.block, self.filled, self._index = self._first_block, 0, 0
        return out

    def _next_block(self) -> None:
        self.block += 1
        self.filled = 0
        self._index = 0

    def _streamed(self) -> Group:
        batch, self._batch = self._batch, []
        self._index += 1
        return Group(self.block, self._index - 1, batch)

    def _close_block(self, last: bool = False) -> list[Group]:
        chunk, self._pending = self._pending, []
        rng = random.Random(derive_seed(self._seed, self.block))
        if self._sampler is not None:
            # The sampler draws from current_rng(): make that this block's generator.
            with use_rng(rng):
                plan = [list(b) for b in self._sampler.get_batch_indices(chunk)]
        else:
            plan = plan_indices(len(chunk), batch_size=self._batch_size,
                                drop_last=self._drop_last and last, shuffle=True,
                                sampler=None, rng=rng)
        return [Group(self.block, k, [chunk[i] for i in b], len(chunk))
                for k, b in enumerate(plan)]


def check_options(
    batch_size: int | None, drop_last: bool, shuffle: bool, sampler: BatchSampler | None
) -> None:
    if sampler is not None:
        if batch_size is not None or drop_last or shuffle:
            raise ValueError(
                "a batch sampler is mutually exclusive with batch_size, drop_last and shuffle"
            )
        return
    if batch_size is None:
        raise ValueError("give either batch_size or a batch sampler")
    _check_batch_size(batch_size)
