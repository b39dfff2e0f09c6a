"""Moving every tensor of a batch to a device."""

from __future__ import annotations

from collections.abc import Mapping
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
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        non_blocking = device.type == "cuda" and obj.is_pinned()
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        items = {k: move_to(v, device) for k, v in obj.items()}
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(move_to(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(v, device) for v in obj)
    return obj
