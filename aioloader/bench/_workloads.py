"""The benchmark's workloads: module-level datasets and collates, importable by spawned workers."""

from __future__ import annotations

import functools
import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset, default_collate

import aioloader

Sample = dict[str, Any]
Collate = Callable[[list[Sample]], Any]
CollateChoice = Literal["none", "torch"]

TINY_LEN = 128
IMAGE_SHAPE = (3, 224, 224)
TEXT_MIN, TEXT_MAX = 16, 512
CPU_SPIN = 5500  # iterations of _spin: about 1 ms of pure Python on a 2020s core
POOL = 16  # distinct samples kept per process; __getitem__ returns views of them
JPEGS = 64  # distinct JPEGs the decode workload cycles through, made once per process
JPEG_QUALITY = 90
NEEDS_PILLOW = ("the decode workload needs Pillow: pip install pillow (or, in a clone of "
                "aioloader, pip install -e '.[bench]')")


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


@functools.cache
def encoded_jpegs() -> tuple[bytes, ...]:
    """``JPEGS`` photo-like 224x224 JPEGs (gradients, noise, shapes), the same in every process.

    Made on first use in each process, so that the dataset itself pickles to nothing.
    """
    try:
        from PIL import Image, ImageDraw
    except ImportError as exc:
        raise ImportError(NEEDS_PILLOW) from exc
    size = IMAGE_SHAPE[1:]
    rng = random.Random(0)
    linear, radial = Image.linear_gradient("L"), Image.radial_gradient("L").resize(size)
    out = []
    for _ in range(JPEGS):
        # noise made at a quarter of the size and scaled up: texture, at a sixteenth the cost
        noise = Image.effect_noise((size[0] // 4, size[1] // 4), rng.uniform(20, 60))
        channels = [linear.rotate(rng.uniform(0, 360)).resize(size), radial,
                    noise.resize(size, Image.Resampling.BILINEAR)]
        rng.shuffle(channels)
        image = Image.merge("RGB", channels)
        draw = ImageDraw.Draw(image)
        for _ in range(8):
            x, y = rng.randrange(size[0]), rng.randrange(size[1])
            r = rng.randrange(8, 64)
            fill = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
        out.append(buffer.getvalue())
    return tuple(out)


def pillow_missing() -> str | None:
    """Why the decode workload cannot run here, or None."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return NEEDS_PILLOW
    return None


class DecodeDataset(_Sized):
    """JPEG bytes decoded with Pillow into uint8[3, 224, 224] (``pil_to_tensor``'s layout):
    a real dataset's decode cost, a new tensor per sample."""

    def __getitem__(self, i: int) -> Sample:
        from PIL import Image  # present: encoded_jpegs() said so on first use

        data = encoded_jpegs()[i % JPEGS]
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
        height, width = IMAGE_SHAPE[1:]
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return {"image": pixels.view(height, width, 3).permute(2, 0, 1), "label": i}


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

    def collates(self, choice: CollateChoice) -> tuple[Collate | None, Collate | None]:
        """aioloader's and the peers' collate; None leaves each loader its own default.

        ``choice="torch"`` passes ``torch.utils.data.default_collate`` explicitly wherever the
        workload has no collate of its own, as many users do.
        """
        if choice == "torch":
            return (self.aio_collate or default_collate, self.torch_collate or default_collate)
        return self.aio_collate, self.torch_collate


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", TinyDataset, 64, 300),
    "image": Workload("image", ImageDataset, 64, 40),
    "image-alloc": Workload("image-alloc", ImageAllocDataset, 64, 40),
    "text": Workload("text", TextDataset, 32, 150, aioloader.PadCollate(), torch_pad_collate),
    "decode": Workload("decode", DecodeDataset, 64, 40),
    "cpu": Workload("cpu", CpuDataset, 32, 25),
}
LAG = "loop-lag"  # streams the image workload while a 1 ms ticker runs in the loop
ALL = (*WORKLOADS, LAG)
FIRST = "first-batch"  # construction to the first batch of a fresh loader: only when asked
FIRST_BATCHES = 8  # batches in the first-batch workload's epoch (one is consumed)


def lag_workload(name: str = LAG) -> Workload:
    """The workload that streams during a loop-lag measurement: ``name``'s, or image's for
    the loop-lag workload itself."""
    return WORKLOADS["image" if name == LAG else name]


def first_workload() -> Workload:
    """The first-batch workload's samples: tiny's, so that start-up is all there is to time."""
    return WORKLOADS["tiny"]

