"""Batch codec: a batch's structure as msgpack data, its tensors as places in an arena slot.

``encode`` is total: for any picklable batch, its tree packs with msgpack. Tensors go into
the slot (or are found there, written by the collate) as ``["T", offset, dtype, shape,
requires_grad]``, a dense one that is not contiguous (channels_last) with its dims' order
after them, and a tensor met before in the batch as ``["R", k]`` (the k-th "T"); bytes of
:data:`BYTES_IN_SLOT` or more as ``["B", offset, length]``.
Containers keep their exact type: ``"d"`` dict, ``"l"`` list, ``"t"`` tuple, ``"n"``
namedtuple, ``"m"`` other mapping rebuilt from its items, ``"o"`` a ``UserDict`` (such as
transformers' ``BatchEncoding``) or a dataclass, rebuilt from its class and pickle state
(its tensors travel through the slot too). Plain msgpack scalars stay bare; a str that is
not valid UTF-8 (``os.fsdecode``'s surrogate escapes) is ``"s"``; anything else is pickled
on its own (``"P"``), never the tree around it. ``decode`` rebuilds it in the parent, each
tensor copied out or leased (``_arena.Lease``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pickle
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from ._arena import ArenaMap, SlotFull, SlotWriter, align

_BARE = (bytes, bool, float, type(None))  # exact types only: subclasses are pickled
_INT64 = (-(1 << 63), (1 << 63) - 1)
# A batch with containers nested deeper than this is pickled whole: msgpack refuses trees
# nested past 1024 levels (each container takes up to two), both walks recurse once per
# level, and a batch that holds itself (a cycle) is only rebuilt exactly by pickle.
_MAX_DEPTH = 100


class _TooDeep(Exception):
    pass


def _is_plain_tensor(t: torch.Tensor) -> bool:
    # is_cpu, not device.type: building a device object costs 0.8 us, this runs per tensor.
    return (type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided
            and not t.is_quantized and not t.is_nested)


_LEAVES = frozenset({str, int, float, bool, type(None)})  # bytes may go in the slot
# bytes this long go through the slot (one copy in, one out) rather than in the header,
# which is packed, sent down the socket, read and unpacked: 4 copies, two on the parent's
# loop. Shorter ones cost less inline than their place in the slot's bookkeeping.
BYTES_IN_SLOT = 4096


def tensors_nbytes(obj: Any, depth: int = 0) -> int:
    """Arena bytes the tensors in ``obj`` need (for sizing a slot): never less than what
    ``encode`` places (more where it pickles a container holding tensors)."""
    cls = type(obj)
    if cls in _LEAVES:  # the common leaves first: this runs once a batch
        return 0
    if cls is bytes:
        return align(len(obj)) if len(obj) >= BYTES_IN_SLOT else 0
    if isinstance(obj, torch.Tensor):
        return align(obj.nbytes) if _is_plain_tensor(obj) else 0
    if depth >= _MAX_DEPTH:
        return 0
    depth += 1
    if cls is dict:
        return _parts_nbytes(obj.keys(), depth) + _parts_nbytes(obj.values(), depth)
    if isinstance(obj, (list, tuple)):
        return _parts_nbytes(obj, depth)
    rebuilt = _rebuilt(obj)
    if rebuilt is not None:
        return tensors_nbytes(rebuilt[1], depth)
    if isinstance(obj, Mapping):
        return _parts_nbytes(obj.keys(), depth) + _parts_nbytes(obj.values(), depth)
    return 0


def _parts_nbytes(parts: Iterable[Any], depth: int) -> int:
    """:func:`tensors_nbytes` summed over ``parts``; leaves cost a set lookup, not a call
    (a list of 64 ints or strings: 4.2 -> 1.8 us; a dict of two tensors: 1.56 -> 1.41 us)."""
    total = 0
    for part in parts:
        if type(part) not in _LEAVES:
            total += tensors_nbytes(part, depth)
    return total


def encode(obj: Any, slot: SlotWriter) -> Any:
    """The msgpack-ready tree of ``obj``, its tensors written into ``slot``. Raises SlotFull
    (with the bytes the whole batch needs), or TypeError for a part that cannot travel."""
    try:
        return _encode(obj, slot, 0)
    except SlotFull:
        raise SlotFull(tensors_nbytes(obj)) from None
    except _TooDeep:
        return ["P", _pickled(obj)]


def _encode(obj: Any, slot: SlotWriter, depth: int) -> Any:
    cls: type = type(obj)
    if cls is str:
        # msgpack packs strict UTF-8 only; a lone surrogate is the one thing a str may hold
        # that is not. ASCII, the common case, needs no trial encoding.
        if obj.isascii():
            return obj
        try:
            obj.encode()
        except UnicodeEncodeError:
            return ["s", obj.encode("utf-8", "surrogatepass")]
        return obj
    if cls in _BARE:
        if cls is bytes and len(obj) >= BYTES_IN_SLOT:
            return ["B", slot.place_bytes(obj), len(obj)]
        return obj
    if cls is int:
        return obj if _INT64[0] <= obj <= _INT64[1] else ["P", _pickled(obj)]
    if isinstance(obj, torch.Tensor):
        if not _is_plain_tensor(obj):
            return ["P", _pickled(obj)]
        again = slot.tensors.get(id(obj))
        if again is not None:  # the same tensor twice: decoded as one, as pickle would
            return ["R", again]
        slot.tensors[id(obj)] = len(slot.tensors)
        t = obj.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        order = _dense_order(t)
        if order is not None:
            t = t.permute(order)
        off = slot.offset_of(t) if t.numel() else 0
        if off is None:
            off = slot.place(t)
        tensor = ["T", off, str(t.dtype)[6:], list(t.shape), obj.requires_grad]
        return tensor if order is None else [*tensor, order]
    if depth >= _MAX_DEPTH:
        raise _TooDeep
    depth += 1
    if cls is dict:
        items: list[Any] = []
        append = items.append
        for k, v in obj.items():
            # An ASCII str, the commonest key and item, inline: the call it saves pays for
            # the str check (batches of small dicts or of names encode no slower for it).
            append(k if type(k) is str and k.isascii() else _encode(k, slot, depth))
            append(v if type(v) is str and v.isascii() else _encode(v, slot, depth))
        return ["d", items]
    if cls is list:
        return ["l", [v if type(v) is str and v.isascii() else _encode(v, slot, depth)
                      for v in obj]]
    if cls is tuple:
        return ["t", [_encode(v, slot, depth) for v in obj]]
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        pickled_cls = _class_bytes(cls)
        if pickled_cls is not None:
            return ["n", pickled_cls, [_encode(v, slot, depth) for v in obj]]
    elif (isinstance(obj, Mapping) and _rebuildable_mapping(cls)
          and not getattr(obj, "__dict__", None)):  # attributes of its own: pickle keeps them
        pickled_cls = _class_bytes(cls)
        if pickled_cls is not None:
            items = []
            for k, v in obj.items():
                items.append(_encode(k, slot, depth))
                items.append(_encode(v, slot, depth))
            return ["m", pickled_cls, items]
    rebuilt = _rebuilt(obj)
    if rebuilt is not None:
        return ["o", rebuilt[0], _encode(rebuilt[1], slot, depth)]
    return ["P", _pickled(obj)]


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dims of a dense but not contiguous tensor (channels_last, a transpose) from the
    largest stride down: permuted so, it is contiguous, and it travels with that order (torch
    keeps a tensor's strides across processes too). None for others: a contiguous tensor, or
    a view with gaps, which travels as a contiguous copy of its own bytes."""
    if t.is_contiguous():
        return None
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    return order if t.permute(order).is_contiguous() else None


def _pickled(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"the batch holds a {type(obj).__module__}.{type(obj).__qualname__} "
            f"({_short(obj)}), which is neither a tensor, a container, a plain value nor "
            f"picklable, so it cannot reach the main process: {exc}") from exc


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


# Bounded caches: a program may make classes on the fly (a namedtuple per call).

@functools.lru_cache(maxsize=256)
def _class_bytes(cls: type) -> bytes | None:
    """``cls`` pickled (by reference: module and name), or None when it cannot be (a local
    class), so that its instances are pickled whole, or say why they cannot be."""
    try:
        return pickle.dumps(cls, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - the caller falls back to pickling the instance
        return None


@functools.lru_cache(maxsize=256)
def _class_from(pickled: bytes) -> Any:
    return pickle.loads(pickled)


@functools.lru_cache(maxsize=256)
def _rebuildable_mapping(cls: type) -> bool:
    """Mapping types that ``cls(list_of_pairs)`` rebuilds (OrderedDict, yes; defaultdict, no)."""
    return cls is collections.OrderedDict or (
        issubclass(cls, dict) and cls.__init__ is dict.__init__ and cls.__new__ is dict.__new__)


@functools.lru_cache(maxsize=256)
def _object_class(cls: type) -> bytes | None:
    """The pickled class if its instances travel as ``"o"``: UserDicts and dataclasses that
    pickle would rebuild as ``cls.__new__(cls)`` plus state (not with their own
    ``__reduce__``, ``__getnewargs__`` or ``__new__``: those are pickled whole)."""
    if not (issubclass(cls, collections.UserDict) or dataclasses.is_dataclass(cls)):
        return None
    if (cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__
            or cls.__new__ is not object.__new__
            or hasattr(cls, "__getnewargs_ex__") or hasattr(cls, "__getnewargs__")):
        return None
    return _class_bytes(cls)


def _rebuilt(obj: Any) -> tuple[bytes, Any] | None:
    """(pickled class, state) when ``obj`` travels as ``"o"``, else None; the state is
    pickle's, ``__getstate__()`` (``BatchEncoding`` keeps its data and encodings)."""
    cls: type = type(obj)
    pickled_cls = _object_class(cls)
    if pickled_cls is None:
        return None
    try:
        state = obj.__getstate__()
    except Exception:  # noqa: BLE001 - pickling the whole object then says what is wrong
        return None
    return pickled_cls, state


def _rebuild(cls: Any, state: Any) -> Any:
    """An instance of ``cls`` with ``state``, as pickle would make it (no ``__init__``)."""
    obj = cls.__new__(cls)
    # Looked up on the class: an instance's __getattr__ (BatchEncoding's reads self.data)
    # must not run before the state is in.
    setstate = getattr(cls, "__setstate__", None)
    if setstate is not None:
        setstate(obj, state)
        return obj
    slots = None
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
        state, slots = state
    if state:
        obj.__dict__.update(state)  # not setattr: a frozen dataclass refuses it
    if slots:
        for name, value in slots.items():
            object.__setattr__(obj, name, value)
    return obj


class TensorAt(Protocol):
    """Where ``decode`` finds a slot's tensors (copied out or leased, ``_arena.Lease``) and
    its bytes (read out in one copy: no tensor made, no view of the slot kept)."""

    def __call__(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor: ...

    def read(self, offset: int, n: int) -> bytes: ...


class Copied:
    """Tensors copied out of ``arena``: the consumer owns them, the slot is free at once."""

    def __init__(self, arena: ArenaMap | None) -> None:
        self.arena = arena

    def __call__(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        assert self.arena is not None, "a batch with tensors arrived before its arena"
        return self.arena.view(offset, dtype, shape).clone()

    def read(self, offset: int, n: int) -> bytes:
        assert self.arena is not None, "a batch with bytes in its slot arrived before its arena"
        return self.arena.read(offset, n)


def decode(tree: Any, tensor_at: TensorAt, tensors: list[torch.Tensor] | None = None) -> Any:
    """Rebuild what ``encode`` wrote, each tensor made by ``tensor_at`` (copied or leased);
    ``tensors``: those decoded so far, in order (``"R"`` names one of them again)."""
    if type(tree) is not list:
        return tree
    if tensors is None:
        tensors = []
    tag = tree[0]
    if tag == "T":
        _, off, dtype_name, shape, requires_grad, *order = tree
        dtype = getattr(torch, dtype_name)
        out = torch.empty(shape, dtype=dtype) if 0 in shape else tensor_at(off, dtype, shape)
        if order:  # its dims back in place (_dense_order)
            out = out.permute([order[0].index(d) for d in range(len(shape))])
        if requires_grad:
            out.requires_grad_(True)
        tensors.append(out)
        return out
    if tag == "R":
        return tensors[tree[1]]
    if tag == "d":
        items = tree[1]
        return {decode(items[i], tensor_at, tensors): decode(items[i + 1], tensor_at, tensors)
                for i in range(0, len(items), 2)}
    if tag == "l":
        return [decode(v, tensor_at, tensors) for v in tree[1]]
    if tag == "t":
        return tuple(decode(v, tensor_at, tensors) for v in tree[1])
    if tag == "B":
        return tensor_at.read(tree[1], tree[2])
    if tag == "s":
        return tree[1].decode("utf-8", "surrogatepass")
    if tag == "P":
        return pickle.loads(tree[1])
    if tag == "o":
        return _rebuild(_class_from(tree[1]), decode(tree[2], tensor_at, tensors))
    if tag == "n":
        return _class_from(tree[1])(*(decode(v, tensor_at, tensors) for v in tree[2]))
    if tag == "m":
        items = tree[2]
        return _class_from(tree[1])(
            [(decode(items[i], tensor_at, tensors), decode(items[i + 1], tensor_at, tensors))
             for i in range(0, len(items), 2)])
    raise ValueError(f"corrupt batch tree: unknown tag {tag!r}")
