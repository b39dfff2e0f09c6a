"""Moving every tensor of a batch to a device, or into pinned memory."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

DeviceLike = int | str | torch.device


def as_device(device: DeviceLike | None) -> torch.device | None:
    """``0`` -> cuda:0, ``"meta"`` -> meta, ``None`` -> None; a clear error otherwise."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise TypeError(f"not a device: {device!r}")
    if isinstance(device, int):
        if device < 0:
            return None  # AllenNLP's convention: a negative cuda_device means the CPU
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {device!r} ({exc})") from exc


def move_to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it on ``device`` (containers keep their types)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        return t.to(device, non_blocking=device.type == "cuda" and t.is_pinned())

    return map_tensors(obj, move)


def pin(obj: Any) -> Any:
    """``obj`` with every CPU tensor in it in page-locked memory (``pin_memory=True``), as
    torch's pin-memory thread does. Fresh pages per batch, never the staging ring's: the
    consumer owns its batch for as long as it likes (a CUDA target pins nothing here)."""
    return map_tensors(obj, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def can_pin() -> bool:
    """Whether pinning means anything here: an accelerator is present (torch's rule)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, in :func:`tensors`' order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # A shallow copy, then its fields replaced: no __init__ or __post_init__ runs, and
        # frozen or slotted dataclasses work too (the codec rebuilds them the same way).
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(new, field.name, map_tensors(getattr(obj, field.name), fn))
        return new
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, in the order :func:`map_tensors` visits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors(getattr(obj, field.name))
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
