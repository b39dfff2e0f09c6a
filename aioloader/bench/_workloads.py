"""The benchmark's workloads: module-level datasets and collates, importable by spawned workers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

import aioloader

Sample = dict[str, Any]
Collate = Callable[[list[Sample]], Any]

TINY_LEN = 128
IMAGE_SHAPE = (3, 224, 224)
TEXT_MIN, TEXT_MAX = 16, 512
CPU_SPIN = 5500  # iterations of _spin: about 1 ms of pure Python on a 2020s core
POOL = 16  # distinct samples kept per process; __getitem__ returns views of them


@functools.cache
def _pool(kind: str) -> torch.Tensor:
    """Preallocated samples, built once per process (so that nothing big is pickled)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "tiny":
        return torch.randint(0, 30000, (POOL, TINY_LEN), dtype=torch.int64, generator=gen)
    return torch.randint(0, 256, (POOL, *IMAGE_SHAPE), dtype=torch.uint8, generator=gen)


class _Sized(Dataset[Sample]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.n})"


class TinyDataset(_Sized):
    """{"ids": int64[128], "label": int}: the loader's per-batch overhead dominates."""

    def __getitem__(self, i: int) -> Sample:
        return {"ids": _pool("tiny")[i % POOL], "label": i}


class ImageDataset(_Sized):
    """uint8[3, 224, 224] images (views of a preallocated pool): bandwidth dominates."""

    def __getitem__(self, i: int) -> Sample:
        return {"image": _pool("image")[i % POOL], "label": i}


class ImageAllocDataset(_Sized):
    """uint8[3, 224, 224] images, a new tensor per sample (as a decode or an augmentation
    makes): the allocation a real dataset pays is part of the measurement."""

    def __getitem__(self, i: int) -> Sample:
        return {"image": _pool("image")[i % POOL].clone(), "label": i}


def text_length(i: int) -> int:
    """Token count of sample ``i``: 16..512, deterministic, well spread."""
    return TEXT_MIN + (i * 7919) % (TEXT_MAX - TEXT_MIN + 1)


class TextDataset(_Sized):
    """Token lists of 16..512 ids, padded by the collate."""

    def __getitem__(self, i: int) -> Sample:
        start = i * 31
        return {"tokens": list(range(start, start + text_length(i))), "label": i}


def _spin(seed: int, n: int = CPU_SPIN) -> int:
    acc = seed
    for k in range(n):
        acc = (acc * 1103515245 + k) & 0xFFFFFFFF
    return acc


class CpuDataset(_Sized):
    """About 1 ms of pure-Python work per sample: compute dominates."""

    def __getitem__(self, i: int) -> Sample:
        value = _spin(i)
        return {"features": torch.full((64,), float(value % 1000)), "label": i}


def torch_pad_collate(batch: list[Sample]) -> dict[str, torch.Tensor]:
    """What ``aioloader.PadCollate()`` gives for text samples, written for torch's loader."""
    tokens = [torch.tensor(sample["tokens"]) for sample in batch]
    return {
        "tokens": pad_sequence(tokens, batch_first=True, padding_value=0),
        "label": torch.tensor([sample["label"] for sample in batch]),
    }


@dataclass(frozen=True)
class Workload:
    """One workload: its dataset, batch size, collates and default batches per epoch."""

    name: str
    dataset: Callable[[int], Dataset[Sample]]
    batch_size: int
    batches: int  # per epoch, by default
    aio_collate: Collate | None = None
    torch_collate: Collate | None = None


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", TinyDataset, 64, 300),
    "image": Workload("image", ImageDataset, 64, 40),
    "image-alloc": Workload("image-alloc", ImageAllocDataset, 64, 40),
    "text": Workload("text", TextDataset, 32, 150, aioloader.PadCollate(), torch_pad_collate),
    "cpu": Workload("cpu", CpuDataset, 32, 25),
}
LAG = "loop-lag"  # streams the image workload while a 1 ms ticker runs in the loop
ALL = (*WORKLOADS, LAG)


def lag_workload() -> Workload:
    """The workload that streams during the loop-lag measurement."""
    return WORKLOADS["image"]

