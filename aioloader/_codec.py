"""Batch codec: a batch's structure as msgpack data, its tensors as places in an arena slot.

``encode`` walks what the collate returned. Tensors go into the slot (or are found already
there, when the collate wrote straight into it) and become ``["T", offset, dtype, shape,
requires_grad]``; containers keep their exact type (``"d"`` dict, ``"l"`` list, ``"t"``
tuple, ``"n"`` namedtuple, ``"m"`` other mapping); plain msgpack scalars stay bare; anything
else is pickled (``"P"``). ``decode`` rebuilds it in the parent, each tensor either copied
out or leased (a view of the slot that gives the slot back once garbage-collected).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._arena import ArenaMap, SlotFull, SlotWriter, align

_BARE = (str, bytes, bool, float, type(None))
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _is_plain_tensor(t: torch.Tensor) -> bool:
    return (t.layout == torch.strided and t.device.type == "cpu" and not t.is_quantized
            and not t.is_nested and type(t) is torch.Tensor)


def tensors_nbytes(obj: Any) -> int:
    """Arena bytes the tensors in ``obj`` need (for sizing a slot)."""
    if isinstance(obj, torch.Tensor):
        return align(obj.numel() * obj.element_size()) if _is_plain_tensor(obj) else 0
    if isinstance(obj, Mapping):
        return sum(tensors_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensors_nbytes(v) for v in obj)
    return 0


def encode(obj: Any, slot: SlotWriter) -> Any:
    """The msgpack-ready tree of ``obj``; tensors are written into ``slot``.

    Raises SlotFull (with the bytes the whole batch needs) when they do not fit.
    """
    try:
        return _encode(obj, slot)
    except SlotFull:
        raise SlotFull(tensors_nbytes(obj)) from None


def _encode(obj: Any, slot: SlotWriter) -> Any:
    cls = type(obj)
    if cls in _BARE:
        return obj
    if cls is int:
        return obj if _INT64[0] <= obj <= _INT64[1] else ["P", _pickled(obj)]
    if isinstance(obj, torch.Tensor):
        if not _is_plain_tensor(obj):
            return ["P", _pickled(obj)]
        t = obj.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        off = slot.offset_of(t) if t.numel() else 0
        if off is None:
            off = slot.place(t)
        return ["T", off, str(t.dtype)[6:], list(t.shape), obj.requires_grad]
    if cls is dict:
        items: list[Any] = []
        for k, v in obj.items():
            items.append(_encode(k, slot))
            items.append(_encode(v, slot))
        return ["d", items]
    if cls is list:
        return ["l", [_encode(v, slot) for v in obj]]
    if cls is tuple:
        return ["t", [_encode(v, slot) for v in obj]]
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        return ["n", _pickled(cls), [_encode(v, slot) for v in obj]]
    if isinstance(obj, Mapping) and _rebuildable_mapping(cls):
        items = []
        for k, v in obj.items():
            items.append(_encode(k, slot))
            items.append(_encode(v, slot))
        return ["m", _pickled(cls), items]
    return ["P", _pickled(obj)]


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


def _rebuildable_mapping(cls: type) -> bool:
    """Mapping types that ``cls(list_of_pairs)`` rebuilds (OrderedDict, yes; defaultdict, no)."""
    import collections

    return cls is collections.OrderedDict or (
        issubclass(cls, dict) and cls.__init__ is dict.__init__ and cls.__new__ is dict.__new__)


TensorAt = Callable[[int, torch.dtype, list[int]], torch.Tensor]


def copied_from(arena: ArenaMap | None) -> TensorAt:
    """Tensors copied out of ``arena``: the consumer owns them, the slot is free at once."""
    def tensor_at(offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        assert arena is not None, "a batch with tensors arrived before its arena"
        return arena.view(offset, dtype, shape).clone()

    return tensor_at


def decode(tree: Any, tensor_at: TensorAt) -> Any:
    """Rebuild what ``encode`` wrote, each tensor made by ``tensor_at`` (copied or leased)."""
    if type(tree) is not list:
        return tree
    tag = tree[0]
    if tag == "T":
        _, off, dtype_name, shape, requires_grad = tree
        dtype = getattr(torch, dtype_name)
        out = torch.empty(shape, dtype=dtype) if 0 in shape else tensor_at(off, dtype, shape)
        if requires_grad:
            out.requires_grad_(True)
        return out
    if tag == "d":
        items = tree[1]
        return {decode(items[i], tensor_at): decode(items[i + 1], tensor_at)
                for i in range(0, len(items), 2)}
    if tag == "l":
        return [decode(v, tensor_at) for v in tree[1]]
    if tag == "t":
        return tuple(decode(v, tensor_at) for v in tree[1])
    if tag == "n":
        return pickle.loads(tree[1])(*(decode(v, tensor_at) for v in tree[2]))
    if tag == "m":
        items = tree[2]
        return pickle.loads(tree[1])(
            [(decode(items[i], tensor_at), decode(items[i + 1], tensor_at))
             for i in range(0, len(items), 2)])
    if tag == "P":
        return pickle.loads(tree[1])
    raise ValueError(f"corrupt batch tree: unknown tag {tag!r}")
