"""A training script whose workers get SIGKILLed (issue 12); run by test_healing in a
subprocess with a hard deadline. Prints one JSON line: the ids it saw and how it ended.

    python heal_victim.py KIND START_METHOD RESTARTS KILL_AFTER [KILL_AFTER ...]

KIND: map | lazy | cached | loads (a lazy reader of keys with an async load) | loads-map
(a map-style dataset with an async __getitem__) | loads-unordered (loads, ordered=False).
After the consumer took batch number k for each KILL_AFTER k (0: before the first batch
arrives), it SIGKILLs the worker that built that batch (for 0, worker 0) and waits until
that process is gone, then goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import aioloader

N = 96


def item(i: int) -> dict[str, Any]:
    return {"i": i, "pid": os.getpid(), "x": torch.full((3,), i)}


class Items(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return item(i)


class Lines(aioloader.Reader):
    def read(self, data_path: Any) -> Any:
        for i in range(N):
            yield item(i)


class Keys(aioloader.Reader):
    """Keys, loaded by the load stage (issue 11): a restart goes on from a key position."""

    def read(self, data_path: Any) -> Any:
        yield from range(N)

    async def load(self, key: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return item(key)


class AsyncItems(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return N

    async def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        await asyncio.sleep(0)
        return item(i)


def collate(items: list[dict[str, Any]]) -> Any:
    """The default collate, with the pid of the process that built the batch."""
    return aioloader.default_collate([dict(it, pid=os.getpid()) for it in items])


def make(kind: str, start_method: str, restarts: int, workers: int = 2) -> aioloader.DataLoader:
    source: Any = {"map": Items(), "loads": Keys(), "loads-map": AsyncItems(),
                   "loads-unordered": Keys()}.get(kind, Lines())
    lazy = 16 if kind in ("lazy", "loads", "loads-unordered") else None
    return aioloader.DataLoader(source, batch_size=4, shuffle=True, seed=7,
                                num_workers=workers,
                                start_method=start_method, max_instances_in_memory=lazy,
                                max_worker_restarts=restarts, collate_fn=collate,
                                ordered=kind != "loads-unordered", quiet=True)


def gone(pid: int) -> None:
    """Wait until ``pid`` is dead (a zombie counts: its parent has not reaped it yet)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)  # polling /proc: there is nothing to wait on for a non-child
    raise TimeoutError(f"pid {pid} still alive")


def main() -> None:
    kind, start_method, restarts, *kills = sys.argv[1:]
    after = sorted(int(k) for k in kills)
    kind, reshaped = kind.removesuffix("-reshaped"), kind.endswith("-reshaped")
    with make(kind, start_method, 0) as uninterrupted:  # closed: its workers must not be
        reference = [b["i"].tolist() for b in uninterrupted]  # taken for the victims
    seen: list[list[int]] = []
    loader = make(kind, start_method, int(restarts))
    if reshaped:  # 3 workers took 4 batches; these 2 go on from that state (issue 21)
        with make(kind, start_method, 0, workers=3) as before:
            batches = iter(before)
            seen = [next(batches)["i"].tolist() for _ in range(4)]
            loader.load_state_dict(before.state_dict())
    error = None
    pids: set[int] = set()
    try:
        if after and after[0] == 0:  # before the first batch: kill as soon as workers exist
            it = iter(loader.sync())
            first = next(it)
            # The first batch already arrived: kill the other worker, which is mid-work.
            victim = next(p for p in _workers() if p != int(first["pid"][0]))
            os.kill(victim, signal.SIGKILL)
            gone(victim)
            seen.append(first["i"].tolist())
            pids.update(first["pid"].tolist())
            batches: Any = it
            after = after[1:]
        else:
            batches = iter(loader)
        for n, batch in enumerate(batches, len(seen) + 1 - 4 * reshaped):
            seen.append(batch["i"].tolist())
            pids.update(batch["pid"].tolist())
            if after and n == after[0]:
                after.pop(0)
                pid = int(batch["pid"][0])
                if pid not in _workers():  # built before an earlier kill: another one
                    pid = _workers()[0]
                os.kill(pid, signal.SIGKILL)
                gone(pid)
    except aioloader.WorkerDied as exc:
        error = {"type": type(exc).__name__, "message": str(exc),
                 "deaths": [str(d) for d in exc.deaths]}
    finally:
        loader.close()
    print(json.dumps({"seen": seen, "reference": reference, "error": error,
                      "pids": len(pids)}))


def _workers() -> list[int]:
    me = str(os.getpid())
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            if fields[1] == me and fields[0] not in "ZX":
                out.append(int(entry))
    return out


if __name__ == "__main__":
    main()
