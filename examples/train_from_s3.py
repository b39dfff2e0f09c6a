"""Train a small CNN on images read from S3, many requests in flight per worker.

The script starts a local S3 server (moto, from ``aioloader.testing``), uploads a generated
image data set to it (one object per image: a label byte, then a uint8 [3, 32, 32] image),
and trains on it with ``FsspecReader("s3://bucket/train/*")``: the workers list the bucket,
and each keeps up to ``concurrency`` GETs in flight, retrying transient failures. Point
``storage_options`` at a real bucket and nothing else changes. At the end it prints the loss
and ``loader.stats()``: the data stall is the share of the time the model waited for data.

    pip install -e ".[s3-local]" -c constraints.txt   # the local S3 (moto) and s3fs
    python examples/train_from_s3.py              # 1024 images, 2 epochs
    python examples/train_from_s3.py --smoke      # a few steps, to check the setup
    AIOLOADER_SMOKE=1 python examples/train_from_s3.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import aioloader
from aioloader.readers import FsspecReader
from aioloader.testing import s3_server

BUCKET = "images"
CLASSES = 4
SHAPE = (3, 32, 32)


def make_images(count: int, seed: int = 0) -> dict[str, bytes]:
    """``train/00042.bin`` -> label byte + image bytes: each class brightens one quadrant."""
    g = torch.Generator().manual_seed(seed)
    objects = {}
    for i in range(count):
        label = i % CLASSES
        image = torch.randint(0, 128, SHAPE, generator=g, dtype=torch.uint8)
        row, col = divmod(label, 2)
        image[:, row * 16:(row + 1) * 16, col * 16:(col + 1) * 16] += 100
        objects[f"train/{i:05d}.bin"] = bytes([label]) + image.numpy().tobytes()
    return objects


def decode(url: str, data: bytes) -> dict[str, torch.Tensor]:
    """One object's bytes -> {"image": float [3, 32, 32] in [0, 1], "label": int}."""
    image = torch.frombuffer(bytearray(data[1:]), dtype=torch.uint8).view(SHAPE)
    return {"image": image.float() / 255, "label": torch.tensor(data[0])}


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


async def train(args: argparse.Namespace, storage_options: dict[str, object]) -> None:
    reader = FsspecReader(f"s3://{BUCKET}/train/*", storage_options=storage_options,
                          decode=decode)
    # Lazy mode (max_instances_in_memory): workers stream the objects every epoch and hold a
    # few blocks at a time, instead of caching the whole bucket in this process.
    loader = aioloader.DataLoader(reader, batch_size=32, shuffle=True, seed=0, num_workers=2,
                                  concurrency=16, retries=3, max_instances_in_memory=128,
                                  batches_per_epoch=args.steps)  # bars on a terminal only
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses: list[float] = []
    async with loader:  # leaving stops the workers
        for epoch in range(args.epochs):
            async for batch in loader:
                loss = F.cross_entropy(model(batch["image"]), batch["label"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            print(f"epoch {epoch + 1}: loss {sum(losses[-5:]) / len(losses[-5:]):.3f}")
        stats = loader.stats()
    print(f"{len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"data stall {stats.data_stall:.1%} (the share of the time spent waiting for data)")
    print(f"loader.stats(): {stats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        default=os.environ.get("AIOLOADER_SMOKE") == "1",
                        help="few objects, one short epoch (also AIOLOADER_SMOKE=1)")
    parser.add_argument("--images", type=int, default=None, help="default 1024 (smoke: 128)")
    parser.add_argument("--epochs", type=int, default=None, help="default 2 (smoke: 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="batches per epoch (default: the whole data set)")
    args = parser.parse_args()
    args.images = args.images or (128 if args.smoke else 1024)
    args.epochs = args.epochs or (1 if args.smoke else 2)
    if args.steps is None and args.smoke:
        args.steps = 3
    torch.manual_seed(0)
    torch.set_num_threads(1)

    started = time.perf_counter()
    with s3_server() as s3:  # a local stand-in for S3, stopped when the block ends
        s3.make_bucket(BUCKET, make_images(args.images))
        print(f"uploaded {args.images} images to s3://{BUCKET}/train/ at {s3.endpoint_url} "
              f"in {time.perf_counter() - started:.1f} s")
        asyncio.run(train(args, s3.storage_options))


if __name__ == "__main__":
    main()
