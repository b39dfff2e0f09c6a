"""Gloo ranks started once and given one job after another (issue 33's chains of shapes).

Spawning a rank costs an interpreter and torch's import (seconds on a loaded machine); a
chain of three shapes in each of dozens of examples would spend minutes on that alone. So
:class:`RankServers` spawns ``size`` processes once; each job is run by the first ``world``
of them, inside a process group made for that job (a fresh file store, ``init_process_group``
then ``destroy_process_group``), so every job is a real ``world``-rank gloo run, as a job
restarted on another shape is. A job is a module-level function ``fn(rank, world, *args)``
named ``"module:function"``; what it returns comes back by rank.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import traceback
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

import torch.multiprocessing as mp


def _serve(conn: Connection, deadline: float) -> None:
    import faulthandler

    import torch.distributed as dist

    while True:
        job = conn.recv()
        if job is None:
            return
        world, rank, store, target, args = job
        module, name = target.split(":")
        faulthandler.dump_traceback_later(deadline - 20, exit=True)  # a hung job says where
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world)
            try:
                result = getattr(importlib.import_module(module), name)(rank, world, *args)
            finally:
                dist.destroy_process_group()
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            conn.send(("error", f"{exc!r}\n{traceback.format_exc()[-3000:]}"))
        finally:
            faulthandler.cancel_dump_traceback_later()


class RankServers:
    """``size`` spawned rank processes (see the module docstring); a context manager."""

    def __init__(self, size: int, deadline: float = 120.0) -> None:
        self.size, self.deadline = size, deadline
        self._dir = tempfile.TemporaryDirectory()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._jobs = 0
        self.retries = 0  # jobs run again after gloo's set-up failed (see ``run``)
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        for _ in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.deadline))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, world: int, target: str, *args: Any) -> list[Any]:
        """``target(rank, world, *args)`` on ranks 0..world-1; the results by rank. A job
        that raises on a rank fails the caller with that rank's traceback."""
        for attempt in (1, 2):
            try:
                return self._run(world, target, args)
            except BaseException as exc:
                self._stop(grace=0.0)  # ranks may hang in a collective, or hold answers
                self._start()  # not read: the next job gets fresh ones
                if attempt == 2 or "connectFullMesh" not in str(exc):
                    raise
                # gloo's set-up between processes under heavy load sometimes fails
                # ("Connection closed by peer"), before the job's own code runs: once more
                self.retries += 1
        raise AssertionError("unreachable")

    def _run(self, world: int, target: str, args: tuple[Any, ...]) -> list[Any]:
        self._jobs += 1
        store = os.path.join(self._dir.name, f"store-{self._jobs}")
        conns = self._conns[:world]
        for rank, conn in enumerate(conns):
            conn.send((world, rank, store, target, args))
        results: dict[int, Any] = {}
        while len(results) < world:
            ready = wait([c for c in conns if conns.index(c) not in results], self.deadline)
            if not ready:
                raise TimeoutError(f"{target} on {world} rank(s): no answer from ranks "
                                   f"{sorted(set(range(world)) - set(results))} within "
                                   f"{self.deadline:.0f} s")
            for answered in ready:
                assert isinstance(answered, Connection)
                status, value = answered.recv()
                rank = conns.index(answered)
                if status != "ok":
                    raise AssertionError(f"{target} on rank {rank} of {world}: {value}")
                results[rank] = value
        return [results[r] for r in range(world)]

    def close(self) -> None:
        self._stop()
        self._dir.cleanup()

    def _stop(self, grace: float = 10.0) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(grace)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> RankServers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
