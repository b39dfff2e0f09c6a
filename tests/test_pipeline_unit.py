"""The pipeline driven directly: no DataLoader, no process (aioloader/pipeline/_pipeline.py).

Source → loads → batcher → collate, as the in-process producers iterate it and as a worker's
``serve()`` wraps it with its wire (run here on this loop, over a socketpair); and the
scoped patches of torch that thread workers need, undone when the last scope ends.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.utils.data as tud
import torch.utils.data._utils.collate as torch_collate
import torch.utils.data._utils.worker as torch_worker

import aioloader
from aioloader._config import Workers
from aioloader._info import TORCH_INFO_PER_THREAD, Patch, WorkerInfo, set_worker_info
from aioloader.pipeline._loads import ALL_SKIPPED, LoadOptions, Retry, SkipLog
from aioloader.pipeline._pipeline import (
    INSTANCE_CHUNK,
    Batch,
    BatchOptions,
    Boundary,
    InOrder,
    Pipeline,
    each,
)
from aioloader.pipeline._stacking import TORCH_COLLATE_IN_THREADS
from aioloader.plane import _wire as wire
from aioloader.plane._dataplane import Shelf
from aioloader.plans._position import BlockStart, ShardPosition, ShardTracker
from aioloader.plans._sources import Kind
from aioloader.workers._local import LocalIndex, LocalInstances, LocalStream
from aioloader.workers._spec import WorkerSpec
from aioloader.workers._steps import PassDone
from aioloader.workers._worker import serve

pytestmark = pytest.mark.deadline(60)

TORCH_CODE = torch_worker.get_worker_info.__code__
TORCH_TENSOR_COLLATE = torch_collate.default_collate_fn_map[torch.Tensor]


class Numbers(aioloader.Reader):
    """0..n-1, read with a plain generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: Any) -> Iterator[int]:
        yield from range(self.n)


class AsyncNumbers(Numbers):
    """0..n-1, read with an async generator."""

    async def read(self, data_path: Any) -> AsyncIterator[int]:  # type: ignore[override]
        for i in range(self.n):
            yield i


class Resumable(Numbers):
    """Keeps its own position (torchdata's Stateful): a resume restores it, reads nothing."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.pos = 0
        self._from = 0
        self.read_from: list[int] = []

    def read(self, data_path: Any) -> Iterator[int]:
        start, self._from = self._from, 0
        self.read_from.append(start)
        for i in range(start, self.n):
            self.pos = i + 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._from = state["pos"]


def options(batch_size: int = 2, chunk: int | None = 4, shuffle: bool = False) -> BatchOptions:
    return BatchOptions(batch_size, drop_last=False, shuffle=shuffle, sampler=None,
                        chunk_size=chunk)


def stream_pipe(source: Any, **kw: Any) -> Pipeline:
    return Pipeline(source, Kind.READER, None, options(**kw), collate_fn=list)


def batches_of(pipe: Pipeline, start: ShardPosition, seed: int = 7) -> list[Batch]:
    steps = pipe.batches(start, seed, None)
    assert isinstance(steps, Iterator), "a sync source without loads: a plain iterator"
    return [s for s in steps if isinstance(s, Batch)]


async def abatches_of(pipe: Pipeline, start: ShardPosition, seed: int = 7) -> list[Any]:
    out = []
    async for step in each(pipe.batches(start, seed, None)):
        out.append(step)
    return out


async def _yield(times: int) -> None:
    for _ in range(times):
        await asyncio.sleep(0)  # a turn of the loop, not a wait: the order is fixed


# ------------------------------------------------------------------ streams

def test_stream_batches_and_marks_across_a_block_boundary() -> None:
    steps = list(stream_pipe(Numbers(10)).batches(ShardPosition(0), 7, None))
    # Blocks of 4 instances (max_instances_in_memory): a block's first batch carries its
    # start; a Boundary says where the next block begins.
    assert steps == [
        Batch([0, 1], [0, 0, [0, 0, None], None]), Batch([2, 3], [0, 1, None, None]),
        Boundary(BlockStart(1, 4, None)),
        Batch([4, 5], [1, 0, [1, 4, None], None]), Batch([6, 7], [1, 1, None, None]),
        Boundary(BlockStart(2, 8, None)),
        Batch([8, 9], [2, 0, [2, 8, None], None]),
    ]


def test_async_reader_gives_the_same_steps() -> None:
    sync = list(stream_pipe(Numbers(11), shuffle=True).batches(ShardPosition(0), 3, None))
    got = asyncio.run(abatches_of(stream_pipe(AsyncNumbers(11), shuffle=True),
                                  ShardPosition(0), 3))
    assert got == sync
    assert sorted(i for s in sync if isinstance(s, Batch) for i in s.items) == list(range(11))


def test_a_block_is_shuffled_within_itself_and_by_its_seed() -> None:
    pipe = stream_pipe(Numbers(12), shuffle=True)
    first = batches_of(pipe, ShardPosition(0), seed=1)
    assert batches_of(pipe, ShardPosition(0), seed=1) == first  # a pass is its seed's
    assert [b.items for b in batches_of(pipe, ShardPosition(0), seed=2)] != \
        [b.items for b in first]
    for b in first:  # blocks of 4: no batch mixes two blocks
        assert {i // 4 for i in b.items} == {b.mark[0]}


@pytest.mark.parametrize("source", [Numbers, Resumable])
def test_resume_mid_pass_gives_the_same_remaining_batches(source: type[Numbers]) -> None:
    full = batches_of(stream_pipe(source(11), batch_size=2, chunk=5, shuffle=True),
                      ShardPosition(0))
    assert len(full) == 6  # blocks of 4, 4, 3 instances
    for k in range(len(full) + 1):
        tracker = ShardTracker(ShardPosition(0))
        for b in full[:k]:
            tracker.delivered(b.mark)  # the consumer's side: positions from marks
        reader = source(11)
        rest = batches_of(stream_pipe(reader, batch_size=2, chunk=5, shuffle=True),
                          tracker.position)
        assert [b.items for b in rest] == [b.items for b in full[k:]]
        assert [b.mark[:2] for b in rest] == [b.mark[:2] for b in full[k:]]
        if isinstance(reader, Resumable):  # reopened at the block's start, not re-read
            assert reader.read_from == [tracker.position.start.raw]


def test_sharding_by_worker_and_rank() -> None:
    def items(**kw: Any) -> list[int]:
        pipe = Pipeline(Numbers(20), Kind.READER, None, options(chunk=None), list, **kw)
        return [i for b in batches_of(pipe, ShardPosition(0)) for i in b.items]

    assert items(worker=1, num_workers=2) == list(range(1, 20, 2))
    assert items(worker=0, num_workers=2, rank=1, world_size=2) == list(range(2, 20, 4))


def test_chunks_of_instances() -> None:
    pipe = Pipeline(Numbers(2 * INSTANCE_CHUNK + 2), Kind.READER, None, None, None)
    chunks = list(pipe.chunks(BlockStart(0, 0), None))
    assert [len(c) for c in chunks] == [INSTANCE_CHUNK, INSTANCE_CHUNK, 2]

    async def read() -> list[list[int]]:
        pipe = Pipeline(AsyncNumbers(2 * INSTANCE_CHUNK + 2), Kind.READER, None, None, None)
        return [c async for c in each(pipe.chunks(BlockStart(0, 0), None))]

    assert asyncio.run(read()) == chunks


# ------------------------------------------------------------------ the load stage

class Keys(tud.Dataset[str]):
    """A map-style dataset whose items are keys for a load function."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> str:
        return self.keys[i]


class Loads:
    """An async load function: later keys finish first; ``flaky`` keys fail once
    (transiently), ``bad`` ones always."""

    def __init__(self, flaky: frozenset[str] = frozenset(),
                 bad: frozenset[str] = frozenset()) -> None:
        self.flaky, self.bad = set(flaky), set(bad)
        self.attempts: collections.Counter[str] = collections.Counter()

    async def __call__(self, key: str) -> dict[str, str]:
        self.attempts[key] += 1
        await _yield(10 - int(key[1:]))
        if key in self.bad or (key in self.flaky and self.attempts[key] == 1):
            raise ConnectionResetError(f"no {key}")
        return {"key": key}


def loads(fn: Loads, *, on_error: str = "skip", concurrency: int = 4) -> LoadOptions:
    return LoadOptions(fn, concurrency, ordered=True, retry=Retry(1, backoff=0.0),
                       on_error=on_error, keyed=True)  # type: ignore[arg-type]


KEYS = Keys([f"k{i}" for i in range(8)])
PLAN = [[3, 1], [0, 2], [5], [7, 6, 4]]


def test_index_batches_with_a_load_stage_come_in_order() -> None:
    fn = Loads(flaky=frozenset({"k1", "k6"}), bad=frozenset({"k5"}))
    pipe = Pipeline(KEYS, Kind.MAP, None, None, list, loads(fn))
    skipped = SkipLog()

    async def run() -> list[Any]:
        stage = pipe.stage(None, skipped.add)
        assert stage is not None

        async def plan() -> AsyncIterator[list[int]]:
            for indices in PLAN:
                yield indices

        async with stage:
            fetches = InOrder(plan(), lambda ix: stage.fetch(pipe.source, ix), ahead=2)
            try:
                return [(ix, pipe.collate(group)) async for ix, group in fetches]
            finally:
                await fetches.aclose()

    got = asyncio.run(run())
    assert [ix for ix, _ in got] == PLAN  # the plan's order, whichever load ended first
    assert [[x["key"] for x in batch] for _, batch in got] == [
        ["k3", "k1"], ["k0", "k2"], [], ["k7", "k6", "k4"]]
    assert fn.attempts["k1"] == fn.attempts["k6"] == 2  # retried once: transient
    assert [(s.key, s.attempts) for s in skipped.skipped] == [("k5", 2)]


def test_local_index_with_a_load_stage() -> None:
    fn = Loads(bad=frozenset({"k5"}))
    skipped = SkipLog()
    producer = LocalIndex(KEYS, lambda pass_no: PLAN, 0, list, timed=False,
                          loads=loads(fn), skips=skipped, ahead=2, plan_ahead=True)

    async def run() -> list[Any]:
        out = []
        producer.attach(private=True)
        try:
            while not isinstance(step := await producer.next(), PassDone):
                out.append([x["key"] for x in step.value])
        finally:
            await producer.aclose(0.0)
        return out

    # The batch whose every key was skipped is passed over.
    assert asyncio.run(run()) == [["k3", "k1"], ["k0", "k2"], ["k7", "k6", "k4"]]
    assert [s.key for s in skipped.skipped] == ["k5"]


def test_local_stream_and_instances_are_the_pipeline() -> None:
    async def run() -> tuple[list[Any], list[Any]]:
        stream = LocalStream(AsyncNumbers(10), Kind.READER, None, options(), list,
                             lambda pass_no: 7, ShardPosition(0), 0, 1, timed=False)
        instances = LocalInstances(Numbers(70), Kind.READER, None, 0, 1, timed=False)
        got: tuple[list[Any], list[Any]] = ([], [])
        for producer, out in ((stream, got[0]), (instances, got[1])):
            producer.attach(private=True)
            try:
                while not isinstance(step := await producer.next(),
                                     PassDone):
                    out.append((step.value, step.mark))
            finally:
                await producer.aclose(0.0)
        return got

    batches, chunks = asyncio.run(run())
    direct = batches_of(stream_pipe(Numbers(10)), ShardPosition(0))
    assert batches == [(b.items, b.mark) for b in direct]
    assert [len(c) for c, _ in chunks] == [INSTANCE_CHUNK, 6]


# ------------------------------------------------------------------ serve(), in-process

class Parent:
    """The parent's end of a worker's socket, on this loop."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.frames = wire.FrameReader()
        self.inbox: collections.deque[wire.Message] = collections.deque()

    async def message(self) -> wire.Message:
        loop = asyncio.get_running_loop()
        while not self.inbox:
            data = await loop.sock_recv(self.sock, 1 << 16)
            assert data, "the worker hung up"
            self.inbox.extend(self.frames.feed(data))
        return self.inbox.popleft()

    async def send(self, msg: wire.Message) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, wire.encode(msg))


def spec_for(source: Any, kind: Kind, plan: str, *, loads: Any = None,
             **workers: Any) -> WorkerSpec:
    """A thread worker's spec; ``workers``: fields of its config part to change."""
    part = Workers(
        num_workers=1, worker_type="thread", start_method="fork", nice=0, slots=2,
        zero_copy=True, max_restarts=0, max_batches=None, max_rss=None,
        init_fn=None, persistent=True, progress=False)
    return WorkerSpec(source=source, kind=kind, data_path=None, plan=plan,  # type: ignore[arg-type]
                      options=options(), collate_fn=list, workers=replace(part, **workers),
                      worker_id=0, rank=0, world_size=1, seed=5, first_pass=0, parent_pid=0,
                      loads=loads)


async def serving(spec: WorkerSpec,
                  talk: Any) -> tuple[list[wire.Message], list[Any], int]:
    """Run ``serve(spec)`` on this loop; ``talk(parent, received, batches, shelf)`` plays the
    parent until it returns (``shelf``: the batches, by slot), then the parent hangs up
    and the worker ends. Received: what ``talk`` kept of the messages."""
    ours, theirs = socket.socketpair()
    shelf = Shelf()
    worker = asyncio.ensure_future(serve(spec, theirs, shelf))
    parent = Parent(ours)
    received: list[wire.Message] = []
    batches: list[Any] = []
    try:
        await talk(parent, received, batches, shelf)
    finally:
        ours.close()
    return received, batches, await worker


def test_serve_wraps_the_stream_pipeline() -> None:
    async def one_pass(parent: Parent, received: list[Any], batches: list[Any],
                       shelf: Shelf) -> None:
        while not isinstance(msg := await parent.message(), wire.PassEnd):
            assert isinstance(msg, wire.Batch)
            batches.append((shelf.items.pop(msg.slot), msg.mark))
            await parent.send(wire.Release(msg.slot))
        received.append(msg)
        # The next pass's first batch takes the last free slot (the pass end holds the
        # other): the worker waits for a slot now, and sees the hang-up there.
        assert isinstance(await parent.message(), wire.Batch)

    spec = spec_for(Numbers(10), Kind.READER, "stream")
    received, batches, code = asyncio.run(serving(spec, one_pass))
    direct = batches_of(spec.pipeline(), ShardPosition(0), spec.seed_for(0))
    assert batches == [(b.items, b.mark) for b in direct]
    assert received == [wire.PassEnd(received[0].slot, 0, len(direct))]  # type: ignore[union-attr]
    assert code == 0


def test_serve_retires_at_a_block_boundary() -> None:
    async def until_retiring(parent: Parent, received: list[Any], batches: list[Any],
                             shelf: Shelf) -> None:
        while not isinstance(msg := await parent.message(), wire.Retiring):
            assert isinstance(msg, wire.Batch)
            batches.append(shelf.items.pop(msg.slot))
            await parent.send(wire.Release(msg.slot))
        received.append(msg)

    spec = spec_for(Numbers(10), Kind.READER, "stream", max_batches=1)
    received, batches, code = asyncio.run(serving(spec, until_retiring))
    # Due after one batch, it hands over where its block ends: the successor's start.
    assert batches == [[0, 1], [2, 3]]
    assert received == [wire.Retiring(ShardPosition(0, BlockStart(1, 4, None)).to_data())]
    assert code == 0


def test_serve_wraps_the_index_pipeline_with_a_load_stage() -> None:
    async def tasks(parent: Parent, received: list[Any], batches: list[Any],
                    shelf: Shelf) -> None:
        for seq, indices in enumerate(PLAN):
            await parent.send(wire.Task(seq, indices))
        while len(batches) < len(PLAN):
            msg = await parent.message()
            if isinstance(msg, wire.Batch):
                batches.append((msg.seq, shelf.items.pop(msg.slot), msg.mark))
                await parent.send(wire.Release(msg.slot))
            else:
                received.append(msg)

    fn = Loads(bad=frozenset({"k5"}))
    spec = spec_for(KEYS, Kind.MAP, "index", loads=loads(fn), slots=len(PLAN))
    received, batches, code = asyncio.run(serving(spec, tasks))
    assert [(seq, batch and [x["key"] for x in batch], mark) for seq, batch, mark in batches] \
        == [(0, ["k3", "k1"], None), (1, ["k0", "k2"], None), (2, None, ALL_SKIPPED),
            (3, ["k7", "k6", "k4"], None)]
    assert [(m.key, m.attempts) for m in received] == [("k5", 2)]  # type: ignore[union-attr]
    assert code == 0


# ------------------------------------------------------------------ scoped patches of torch

def test_a_patch_lives_as_long_as_its_scopes() -> None:
    made: list[str] = []

    def apply() -> Any:
        made.append("apply")
        return lambda: made.append("undo")

    patch = Patch(apply)
    both_in = threading.Barrier(2)
    first_out = threading.Event()

    def scope(wait_for_first: bool) -> None:
        with patch.scope():
            both_in.wait(10)
            if wait_for_first:
                first_out.wait(10)
        if not wait_for_first:
            first_out.set()

    threads = [threading.Thread(target=scope, args=(w,)) for w in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert made == ["apply", "undo"]  # once for both, undone by the last to leave
    assert not patch.active


def test_torch_answers_per_thread_only_inside_the_scope() -> None:
    info = WorkerInfo(num_workers=2, id=1, seed=3)
    seen: list[Any] = []

    def worker() -> None:
        set_worker_info(info, thread=True)
        seen.append(tud.get_worker_info())

    with TORCH_INFO_PER_THREAD.scope(), TORCH_COLLATE_IN_THREADS.scope():
        assert torch_worker.get_worker_info.__code__ is not TORCH_CODE
        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        assert tud.get_worker_info() is None  # this thread is no worker
    assert seen[0].id == 1 and seen[0].num_workers == 2
    assert torch_worker.get_worker_info.__code__ is TORCH_CODE
    assert torch_collate.default_collate_fn_map[torch.Tensor] is TORCH_TENSOR_COLLATE


class Watched(tud.Dataset[int]):
    """Notes, as it is read, whether torch is patched."""

    def __init__(self) -> None:
        self.patched: set[bool] = set()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        self.patched.add(torch_worker.get_worker_info.__code__ is not TORCH_CODE)
        return i


@pytest.mark.parametrize("workers", [(0, "process"), (2, "thread")])
def test_torch_is_itself_again_after_a_loader_closes(workers: tuple[int, str]) -> None:
    num_workers, kind = workers
    data = Watched()
    with aioloader.DataLoader(data, batch_size=4, num_workers=num_workers,
                              worker_type=kind, quiet=True) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for t in threading.enumerate():
        if t.name.startswith("aioloader-worker-"):
            t.join(30)
    # Patched only where thread workers need it, and only while they live.
    assert data.patched == {num_workers > 0}
    assert not TORCH_INFO_PER_THREAD.active and not TORCH_COLLATE_IN_THREADS.active
    assert torch_worker.get_worker_info.__code__ is TORCH_CODE
    assert torch_collate.default_collate_fn_map[torch.Tensor] is TORCH_TENSOR_COLLATE
