"""Data-parallel training on CPU: each rank runs its own aioloader DataLoader.

The loader shards the reader across ranks x workers by itself (worker k of rank r keeps
instances r * num_workers + k, r * num_workers + k + world_size * num_workers, ...), so
together the ranks see every instance exactly once per epoch.

    torchrun --nproc_per_node 2 examples/distributed.py
    python examples/distributed.py          # launches its 2 ranks itself
    AIOLOADER_SMOKE=1 python examples/distributed.py
"""

import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import aioloader

SMOKE = os.environ.get("AIOLOADER_SMOKE") == "1"
SIZE = 64 if SMOKE else 4096  # a multiple of world_size * num_workers * batch_size


class Points(aioloader.Reader):
    """Noisy points on the line y = 3x - 1."""

    def read(self, size):
        g = torch.Generator().manual_seed(0)
        for i in range(size):
            x = torch.randn(1, generator=g)
            yield {"id": i, "x": x, "y": 3 * x - 1 + 0.1 * torch.randn(1, generator=g)}


def train() -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the env
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Every rank must take the same number of steps, or DDP's all-reduce waits forever.
    # SIZE splits evenly here; even_batches=True evens out the ranks' batches when it does not.
    loader = aioloader.DataLoader(Points(), SIZE, batch_size=4, num_workers=2, quiet=True,
                                  even_batches=True)

    seen = torch.zeros(SIZE)
    with loader:
        for batch in loader:
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            seen[batch["id"]] += 1
    count = torch.tensor(int(seen.sum()))
    print(f"rank {rank}: {int(count)} instances, last loss {loss.item():.4f}")

    dist.all_reduce(count)
    dist.all_reduce(seen)
    if rank == 0:
        assert int(count) == SIZE and bool((seen == 1).all()), "ranks overlapped or missed some"
        w, b = model.module.weight.item(), model.module.bias.item()
        print(f"{world_size} ranks saw {int(count)} instances: the union is the dataset, "
              f"each instance once. Fitted y = {w:.2f}x {b:+.2f}")
    # Every rank done with its collectives before any tears its connections down: gloo can
    # abort a rank at exit ("terminate called without an active exception") otherwise.
    dist.barrier()
    dist.destroy_process_group()


def launch(world_size: int = 2) -> None:
    """What torchrun does, in short: one process per rank, rendezvous on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen([sys.executable, __file__], env=env))
    try:
        # If one rank fails the others would wait for it at the next all-reduce: watch all.
        while any(p.poll() is None for p in ranks) and not any(p.returncode for p in ranks):
            time.sleep(0.1)
    finally:
        for p in ranks:  # one rank failed or we were interrupted: stop the others
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in ranks]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    if "RANK" in os.environ:
        train()
    else:
        launch()
