"""The GPU path (issue 13): the pinned staging ring, its ordering, checked without a GPU.

``FakeGpu`` is a backend whose "device" memory is the CPU and whose copies lag: a copy runs
only when an event after it is synchronized, or when the test runs what a consumer stream
waited for. A stager that refilled a buffer before its copy ran, or handed a batch over
without the consumer waiting for its event, gives wrong bytes here. Plain ``.to()`` for
other devices is checked on the meta device.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import threading
from typing import Any, NamedTuple

import pytest
import torch

import aioloader
from aioloader import _config
from aioloader.plane import _staging
from aioloader.plane._staging import SLOTS, Stager
from aioloader.run import _epoch

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAKE_DEVICE = torch.device("meta")  # what the fake calls its device: tensors there pass through


# ------------------------------------------------------------------ the fake backend

class FakeStream:
    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu, self.name = gpu, name
        self.ops: list[tuple[torch.Tensor, torch.Tensor]] = []  # (out, src) copies, queued
        self.ran = 0  # how many of them ran
        self.waits: list[tuple[FakeStream, int]] = []  # (stream, position) waited for

    def wait_event(self, event: FakeEvent) -> None:
        assert event.stream is not None, "waiting on an event never recorded"
        self.waits.append((event.stream, event.position))
        self.gpu.log.append(("wait", self.name, event.name, event.generation))

    def run_to(self, position: int) -> None:
        while self.ran < position:
            out, src = self.ops[self.ran]
            out.copy_(src)
            self.ran += 1


class FakeEvent:
    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu, self.name = gpu, name
        self.stream: FakeStream | None = None
        self.position = 0
        self.generation = 0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.position = stream, len(stream.ops)
        self.generation += 1
        self.gpu.log.append(("record", self.name, self.generation))
        if self.gpu.eager:
            stream.run_to(self.position)

    def query(self) -> bool:
        done = self.stream is None or self.stream.ran >= self.position
        self.gpu.log.append(("query", self.name, done))
        return done

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_to(self.position)
        self.gpu.log.append(("synchronize", self.name, self.generation))


class FakeGpu:
    """A lagging device made of CPU memory; every call it gets is logged."""

    def __init__(self, *, eager: bool = False) -> None:
        self.device = FAKE_DEVICE
        self.eager = eager  # copies run as soon as their event is recorded (a fast GPU)
        self.log: list[tuple[Any, ...]] = []
        self.side = FakeStream(self, "side")
        self.sides = 0
        self.allocated: list[int] = []
        self._consumers: dict[str, FakeStream] = {}
        self._events = 0

    def side_stream(self) -> FakeStream:
        self.sides += 1
        return self.side

    def current_stream(self) -> FakeStream:
        name = threading.current_thread().name  # CUDA's current stream is per thread
        return self._consumers.setdefault(name, FakeStream(self, name))

    def event(self) -> FakeEvent:
        self._events += 1
        return FakeEvent(self, f"e{self._events}")

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.allocated.append(nbytes)
        self.log.append(("pinned", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, src: torch.Tensor, stream: FakeStream) -> torch.Tensor:
        if src.layout != torch.strided:  # not staged: copied straight from its own memory
            self.log.append(("copy", stream.name, None))
            return src.clone()
        base = src.untyped_storage().data_ptr()
        lo = base + src.storage_offset() * src.element_size()
        hi = lo + src.numel() * src.element_size()
        for _, queued in stream.ops[stream.ran:]:  # bytes a queued copy has yet to read
            qlo = queued.untyped_storage().data_ptr() + (
                queued.storage_offset() * queued.element_size())
            qhi = qlo + queued.numel() * queued.element_size()
            assert not (lo < qhi and qlo < hi), "staging bytes refilled under a queued copy"
        out = torch.empty(src.shape, dtype=src.dtype)
        raw(out).fill_(0xA5)  # what a consumer that did not wait would read
        stream.ops.append((out, src))
        self.log.append(("copy", stream.name, lo))
        return out

    def keep_for(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("keep", id(tensor), stream.name))

    def run_waited(self, stream: FakeStream) -> None:
        """What the GPU has done by the time ``stream`` runs what follows its waits."""
        for side, position in stream.waits:
            side.run_to(position)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values, in order (dtype-blind, NaN-safe comparisons)."""
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same(got: Any, want: Any) -> None:
    """``got`` is ``want``: container types, tensor dtypes, shapes and bytes."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.layout) == (want.dtype, want.shape, want.layout)
        if want.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        assert torch.equal(raw(got), raw(want)), (got, want)
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            same(getattr(got, field.name), getattr(want, field.name))
    elif isinstance(want, collections.abc.Mapping):
        assert list(got) == list(want)
        for k in want:
            same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            same(g, w)
    else:
        assert got == want


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    """The fake, as what ``cuda:*`` targets get (the loader's own stagers included)."""
    fake = FakeGpu()
    monkeypatch.setattr(_staging, "backend_for", lambda device: fake)
    return fake


# ------------------------------------------------------------------ batches

class Pair(NamedTuple):
    left: torch.Tensor
    right: Any


class Encoding(collections.UserDict[str, Any]):
    """A UserDict subclass, as transformers' BatchEncoding is."""


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    label: str
    extra: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Frozen:
    y: torch.Tensor


def rich(samples: list[int]) -> Any:
    """A batch of every kind the loader returns, made from ``samples`` deterministically."""
    g = torch.Generator().manual_seed(sum(samples) + 1000 * len(samples))
    floats = torch.randn(6, 8, generator=g)
    tensors = {
        "f32": floats, "f16": floats.half(), "bf16": floats.bfloat16(), "f64": floats.double(),
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "c128": torch.randn(2, 3, dtype=torch.complex128, generator=g),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "i16": torch.randint(-999, 999, (3, 3), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (4,), dtype=torch.int32, generator=g),
        "i64": torch.tensor(samples, dtype=torch.int64),
        "u8": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "zero_d": torch.tensor(float(sum(samples))),
        "empty": torch.empty(0, 4),
        "empty_i64": torch.empty(3, 0, dtype=torch.int64),
        "special": torch.tensor([math.nan, math.inf, -math.inf, -0.0]),
        "transposed": torch.randn(6, 10, generator=g).t(),
        "strided": torch.arange(40, dtype=torch.int16).reshape(5, 8)[:, ::3],
        "big": torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, generator=g),
    }
    return (
        tensors,
        Pair(torch.randn(2, 2, generator=g), [torch.tensor([True]), "text", 3, None]),
        Encoding({"input_ids": torch.arange(len(samples) * 3).reshape(len(samples), 3),
                  "note": "kept"}),
        Record(torch.randn(3, generator=g), "a label", {"m": torch.ones(2, dtype=torch.bool)}),
        Frozen(torch.arange(4, dtype=torch.float64)),
        [torch.tensor(len(samples)), 1.5, "s"],
    )


def sizes(n: int) -> list[torch.Tensor]:
    return [torch.full((n,), 7, dtype=torch.uint8), torch.arange(3)]


# ------------------------------------------------------------------ the ring, unit level

def test_no_staging_allocation_per_batch_after_warm_up(gpu: FakeGpu) -> None:
    stager = Stager(torch.device("cuda", 0))
    for _ in range(10):
        stager.stage(sizes(1000))
    assert len(gpu.allocated) == SLOTS  # one buffer per slot, once
    for _ in range(10):
        stager.stage(sizes(10))  # smaller batches fit
    assert len(gpu.allocated) == SLOTS
    stager.stage(sizes(3000))  # does not fit: that slot grows, geometrically
    assert len(gpu.allocated) == SLOTS + 1
    assert gpu.allocated[-1] >= 2 * gpu.allocated[0]
    for _ in range(10):
        stager.stage(sizes(3000))
    assert len(gpu.allocated) == 2 * SLOTS  # the other slot grew once too, then no more
    assert _staging.ring_allocations() >= len(gpu.allocated)
    assert gpu.sides == 1  # the side stream is taken once, not per batch


def test_the_consumer_waits_for_its_batch_s_event_before_it_gets_it(gpu: FakeGpu) -> None:
    stager = Stager(torch.device("cuda", 0))
    consumer = gpu.current_stream()
    for i in range(5):
        start = len(gpu.log)
        batch = stager.stage({"a": torch.full((4,), i), "b": [torch.tensor(i)]})
        this = gpu.log[start:]
        kinds = [entry[0] for entry in this]
        record = kinds.index("record")
        assert kinds.count("copy") == 2 and max(
            k for k, kind in enumerate(kinds) if kind == "copy") < record
        event, generation = this[record][1:]
        wait = kinds.index("wait")
        assert wait > record and this[wait] == ("wait", consumer.name, event, generation)
        kept = {entry[1] for entry in this[wait:] if entry[0] == "keep"}
        assert kept == {id(batch["a"]), id(batch["b"][0])}
        assert all(entry[2] == consumer.name for entry in this if entry[0] == "keep")
        # What the consumer's stream sees after its wait is the batch.
        gpu.run_waited(consumer)
        assert batch["a"].tolist() == [i] * 4 and batch["b"][0].item() == i


def test_a_buffer_is_never_refilled_before_its_copy_completed(gpu: FakeGpu) -> None:
    """The GPU lags as far as it can: copies run only when an event is synchronized."""
    stager = Stager(torch.device("cuda", 0))
    wanted = [rich([i, i + 1]) for i in range(7)]
    got = [stager.stage(batch) for batch in wanted]  # the fake asserts no refill under a copy
    syncs = [entry for entry in gpu.log if entry[0] == "synchronize"]
    assert len(syncs) == len(wanted) - SLOTS  # each reuse of a slot waited for its copy
    gpu.run_waited(gpu.current_stream())
    for g, w in zip(got, wanted, strict=True):
        same(g, w)


def test_a_finished_copy_is_not_waited_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = FakeGpu(eager=True)
    monkeypatch.setattr(_staging, "backend_for", lambda device: fast)
    stager = Stager(torch.device("cuda", 0))
    for i in range(6):
        same(stager.stage(sizes(100 + i)), sizes(100 + i))
    assert not [entry for entry in fast.log if entry[0] == "synchronize"]


def test_staging_is_byte_exact_and_passes_device_tensors_and_values_through(
        gpu: FakeGpu) -> None:
    stager = Stager(torch.device("cuda", 0))
    on_device = torch.empty(2, 3, device=FAKE_DEVICE)
    lazy = torch.randn(4, dtype=torch.complex64)
    batch = (rich([3, 4]), lazy.conj(), lazy.conj().imag, torch.randn(3, 4).to_sparse())
    out = stager.stage({"batch": batch, "here": on_device, "n": 5})
    gpu.run_waited(gpu.current_stream())
    same(out["batch"], batch)
    assert out["here"] is on_device and out["n"] == 5


def test_a_slot_too_small_for_the_batch_is_waited_for_then_grown(gpu: FakeGpu) -> None:
    stager = Stager(torch.device("cuda", 0), slots=1)
    first = stager.stage(sizes(64))
    second = stager.stage(sizes(10_000))  # the only slot: its copy must finish first
    assert [e[0] for e in gpu.log].index("synchronize") < [
        e for e, entry in enumerate(gpu.log) if entry[0] == "pinned"][1]
    gpu.run_waited(gpu.current_stream())
    same(first, sizes(64))
    same(second, sizes(10_000))


# ------------------------------------------------------------------ through the loader

def loader_of(n: int, **kwargs: Any) -> aioloader.DataLoader:
    return aioloader.DataLoader(list(range(n)), batch_size=2, collate_fn=rich, quiet=True,
                                **kwargs)


def through(loader: aioloader.DataLoader, face: str, device: str) -> list[Any]:
    """One epoch's batches: ``sync(device=)``, or ``for`` / ``async for`` with the loader's
    ``cuda_device``."""
    if face == "sync":
        return list(loader.sync(device=device))
    if face == "cuda_device":
        return list(loader)

    async def consume() -> list[Any]:
        return [batch async for batch in loader]

    return asyncio.run(consume())


def expected(n: int) -> list[Any]:
    return [rich(list(range(i, min(i + 2, n)))) for i in range(0, n, 2)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("face", ["sync", "cuda_device", "async"])
def test_loader_batches_reach_cuda_through_the_ring(gpu: FakeGpu, num_workers: int,
                                                    face: str) -> None:
    """Leased batches (1 MiB each) included; every batch is the consumer's own after the
    next batch and after close."""
    n = 12
    with loader_of(n, num_workers=num_workers,
                   cuda_device="cuda:0" if face != "sync" else None) as loader:
        got = through(loader, face, "cuda:0")
    gpu.run_waited(gpu.current_stream())
    want = expected(n)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        same(g, w)
    assert len(gpu.allocated) <= SLOTS  # equal-size batches: the ring never grew


def test_no_batch_is_taken_ahead_of_the_consumer(gpu: FakeGpu) -> None:
    with loader_of(12, num_workers=2) as loader:
        it = iter(loader.sync(device="cuda:0"))
        next(it), next(it), next(it)
        state = loader.state_dict()
        del it
    with loader_of(12, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed.sync(device="cuda:0"))
    gpu.run_waited(gpu.current_stream())
    for g, w in zip(rest, expected(12)[3:], strict=True):
        same(g, w)
    assert len(rest) == 3


def test_the_consumer_stream_is_the_caller_s_when_the_loop_runs_in_a_thread(
        gpu: FakeGpu) -> None:
    """Inside a running loop (Jupyter) the sync adapter's loop runs in a helper thread;
    CUDA's current stream is per thread, so the caller's is captured where it calls."""
    with loader_of(4) as loader:
        async def notebook_cell() -> list[Any]:
            return list(loader.sync(device="cuda:0"))

        got = asyncio.run(notebook_cell())
    caller = threading.current_thread().name
    waiters = {entry[1] for entry in gpu.log if entry[0] == "wait"}
    assert waiters == {caller}
    assert {entry[2] for entry in gpu.log if entry[0] == "keep"} == {caller}
    gpu.run_waited(gpu.current_stream())
    for g, w in zip(got, expected(4), strict=True):
        same(g, w)


def test_pin_memory_never_pins_for_a_cuda_target(gpu: FakeGpu,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[Any] = []

    def pin(batch: Any) -> Any:
        pinned.append(batch)
        return batch

    monkeypatch.setattr(_epoch, "pin", pin)
    monkeypatch.setattr(_config, "can_pin", lambda: True)  # as on a machine with an accelerator
    with loader_of(4, pin_memory=True) as loader:
        list(loader.sync(device="cuda:0"))
        assert not pinned  # the ring is pinned already
        list(loader)
        assert len(pinned) == 2  # a CPU batch is pinned, fresh for the consumer


# ------------------------------------------------------------------ other devices: .to()

class Shapes(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3, 4), i, dtype=torch.bfloat16), "y": torch.tensor(i),
                "m": torch.tensor([True, False])}


def no_stager(device: torch.device) -> Any:
    raise AssertionError(f"the staging ring is for CUDA only, not {device}")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("face", ["sync", "cuda_device", "async"])
def test_meta_targets_use_plain_moves(num_workers: int, face: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_staging, "backend_for", no_stager)
    with aioloader.DataLoader(Shapes(), batch_size=4, num_workers=num_workers, quiet=True,
                              cuda_device=None if face == "sync" else "meta") as loader:
        got = through(loader, face, "meta")
    assert [b["x"].shape for b in got] == [(4, 3, 4), (2, 3, 4)]
    for b in got:
        assert {t.device.type for t in b.values()} == {"meta"}
        assert [t.dtype for t in b.values()] == [torch.bfloat16, torch.int64, torch.bool]
        assert b["m"].shape[1:] == (2,)


def test_move_to_keeps_dataclasses_and_moves_their_tensors() -> None:
    from aioloader.plane._device import move_to

    moved = move_to(rich([1, 2]), torch.device("meta"))
    want = rich([1, 2])
    assert type(moved[3]) is Record and moved[3].x.is_meta and moved[3].label == "a label"
    assert moved[3].extra["m"].is_meta and type(moved[4]) is Frozen and moved[4].y.is_meta
    assert type(moved[2]) is Encoding and moved[2]["input_ids"].shape == want[2][
        "input_ids"].shape


# ------------------------------------------------------------------ the GPU check script

SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the script's CPU-only exit")
def test_gpu_check_says_no_cuda_and_exits_0_without_a_gpu() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA" in proc.stdout


def script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def trace(events: list[dict[str, Any]], tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def memcpy(ts: float, dur: float, stream: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": ts, "dur": dur, "args": {"stream": stream, "device": 0}}


def kernel(ts: float, dur: float, stream: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0}}


def test_gpu_check_reads_overlap_from_a_chrome_trace(tmp_path: pathlib.Path) -> None:
    overlap = script().overlap
    found = overlap(trace([kernel(0, 100, 7), memcpy(50, 100, 13), memcpy(300, 10, 13),
                           kernel(400, 10, 7), {"ph": "M", "name": "process_name"}],
                          tmp_path))
    assert found.copy_streams == {13} and found.compute_streams == {7}
    assert found.fraction == pytest.approx(50 / 110) and found.pageable == 0
    serial = overlap(trace([kernel(0, 100, 7), memcpy(100, 20, 7)], tmp_path))
    assert serial.fraction == 0 and serial.copy_streams == serial.compute_streams
