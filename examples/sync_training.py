"""The byte-level language model of train_lm.py, driven from an ordinary synchronous script.

No ``async`` anywhere: ``loader.sync(device=...)`` runs the loader's event loop for you and
moves every batch to the device. The workers, the arena and the reader are the same.

    python examples/sync_training.py
    AIOLOADER_SMOKE=1 python examples/sync_training.py
"""

import os
import time

import torch
from torch import nn
from train_lm import ByteGRU, lm_loss, make_loader, stdlib_files

SMOKE = os.environ.get("AIOLOADER_SMOKE") == "1"


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = 10 if SMOKE else 150
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    files = stdlib_files("train", 20 if SMOKE else 200)
    loader = make_loader(files, batch_size=32, workers=2, max_instances_in_memory=2048,
                         batches_per_epoch=steps)
    model = ByteGRU().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    losses = []
    started = time.perf_counter()
    with loader:  # closing the loader stops its workers
        for batch in loader.sync(device=device):
            assert batch["tokens"].device.type == device.type
            loss = lm_loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == 1 or len(losses) % 25 == 0:
                print(f"step {len(losses):4d}  loss {loss.item():.3f}")
    elapsed = time.perf_counter() - started
    print(f"{len(losses)} batches on {device} in {elapsed:.1f} s; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
