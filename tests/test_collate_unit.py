"""Unit tests of aioloader.pipeline._collate: parity with torch's default_collate, allocator,
PadCollate."""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import pickle
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate as torch_collate

from aioloader._errors import CollateKeyError
from aioloader.pipeline._collate import PadCollate, default_collate
from aioloader.pipeline._recycle import Recycler
from aioloader.pipeline._stacking import (
    SPLIT_BYTES,
    ConsumerWaits,
    copy_helper,
    new_tensor,
    use_allocator,
)

# ------------------------------------------------------------------------------ helpers


def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """Equal in type, structure, dtype, shape and bits."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
        assert a.device == b.device, f"{where}: {a.device} != {b.device}"
        # compare bits, so that NaNs and -0.0 count too
        ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert torch.equal(ab, bb), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def both(samples: list[Any]) -> tuple[Any, Any]:
    return default_collate(samples), torch_collate(samples)


def raises_like_torch(samples: list[Any]) -> BaseException:
    with pytest.raises(Exception) as theirs:
        torch_collate(samples)
    with pytest.raises(type(theirs.value)) as ours:
        default_collate(samples)
    return ours.value


def dtype_tensor(dtype: torch.dtype, i: int) -> torch.Tensor:
    base = torch.tensor([[i, i + 1, 2], [3, 0, i % 5]], dtype=torch.float64)
    if dtype is torch.bool:
        return base.remainder(2) == 1
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def collatable_dtypes() -> list[torch.dtype]:
    warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
    out = []
    for name in sorted(dir(torch)):
        dt = getattr(torch, name)
        if isinstance(dt, torch.dtype) and dt not in out:
            try:
                torch_collate([dtype_tensor(dt, 0), dtype_tensor(dt, 1)])
            except Exception:  # noqa: BLE001 - torch cannot batch this dtype: skip it
                continue
            out.append(dt)
    return out


class Point(NamedTuple):
    x: Any
    y: Any


class Arena:
    """A test allocator: hands out consecutive slices of one buffer and records them."""

    def __init__(self, nbytes: int = 1 << 24) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0
        self.calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.calls.append((shape, dtype))
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = -(-self.used // 64) * 64
        self.used = start + n
        return self.buffer[start : start + n].view(dtype).view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        lo = self.buffer.data_ptr()
        return lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= lo + self.buffer.nbytes


# ------------------------------------------------------------------------------ parity

SAMPLES: dict[str, Callable[[int], Any]] = {
    "int": lambda i: i,
    "big_int": lambda i: 2**40 + i,
    "float": lambda i: i * 0.5 - 1.25,
    "bool": lambda i: i % 3 == 0,
    "int_then_float": lambda i: i if i == 0 else i + 0.5,
    "str": lambda i: f"s{i}",
    "bytes": lambda i: f"b{i}".encode(),
    "str_int_tuple": lambda i: ("12345"[i % 5], i),
    "dict_nested": lambda i: {"a": torch.empty(4, 2).fill_(i), "b": {"n": i, "s": [i, "x"]}},
    "list_ints": lambda i: [i, i + 1, i + 2],
    "tuple_mixed": lambda i: (torch.tensor([i, -i]), float(i), "x", i % 2 == 0),
    "list_of_dicts": lambda i: [{"a": i}, {"a": -i, "b": torch.tensor(i)}],
    "ordered_dict": lambda i: collections.OrderedDict(z=i, a=float(i)),
    "defaultdict": lambda i: collections.defaultdict(list, {"k": i}),
    "namedtuple": lambda i: Point(torch.tensor([i]), {"y": i}),
    "namedtuple_nested": lambda i: Point(Point(i, "s"), [i, i]),
    "numpy_f64": lambda i: np.ones((2, 3, 4)) * i,
    "numpy_i32": lambda i: np.arange(6, dtype=np.int32).reshape(2, 3) + i,
    "numpy_bool": lambda i: np.array([i % 2 == 0, True, False]),
    "numpy_0d": lambda i: np.array(i, dtype=np.float32),
    "numpy_noncontig": lambda i: (np.arange(12.0).reshape(3, 4) + i).T,
    "numpy_str_scalar": lambda i: np.str_(f"s{i}"),
    "tensor_0d": lambda i: torch.tensor(float(i) + 0.25),
    "tensor_0d_bool": lambda i: torch.tensor(i % 2 == 1),
    "tensor_empty": lambda i: torch.empty(0),
    "tensor_2x0x3": lambda i: torch.zeros(2, 0, 3, dtype=torch.int16),
    "tensor_noncontig": lambda i: (torch.arange(12).reshape(3, 4) + i).t(),
    "tensor_expanded": lambda i: torch.tensor([i]).expand(3, 4),
    "tensor_channels_last": lambda i: torch.full((1, 2, 3, 3), i).contiguous(
        memory_format=torch.channels_last
    ),
    "tensor_nan": lambda i: torch.tensor([float("nan"), -0.0, i]),
    "tensor_bf16_0d": lambda i: torch.tensor(i, dtype=torch.bfloat16),
    "mixed_dtype_tensors": lambda i: torch.tensor([i], dtype=torch.float32 if i else torch.int64),
    "float_then_double": lambda i: torch.tensor([i + 0.1], dtype=torch.float64 if i else None),
}
SAMPLES.update(
    {
        f"np_{name}": (lambda t: lambda i: t(i % 2))(getattr(np, name))
        for name in ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8"]
    }
)
SAMPLES["np_bool"] = lambda i: np.bool_(i % 2)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
@pytest.mark.parametrize("n", [1, 4])
def test_equals_torch_default_collate(kind: str, n: int) -> None:
    ours, theirs = both([SAMPLES[kind](i) for i in range(n)])
    assert_same(ours, theirs, kind)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", collatable_dtypes(), ids=str)
def test_every_dtype_torch_supports(dtype: torch.dtype) -> None:
    samples = [dtype_tensor(dtype, i) for i in range(3)]
    assert_same(*both(samples), str(dtype))
    arena = Arena()
    with use_allocator(arena):
        out = default_collate(samples)
    assert_same(out, torch_collate(samples), f"{dtype} through an allocator")
    assert arena.owns(out)


def test_bools_become_a_bool_tensor_like_torch() -> None:
    out = default_collate([True, False, True])
    assert out.dtype == torch.bool
    assert_same(out, torch_collate([True, False, True]))


def test_tuples_of_str_stay_tuples_like_torch() -> None:
    # torch hands zip()'s tuples to the str branch, which returns them as they are
    out = default_collate([("a", 1), ("b", 2)])
    assert out[0] == ("a", "b")
    assert_same(out, torch_collate([("a", 1), ("b", 2)]))


def test_requires_grad_batches_like_torch() -> None:
    samples = [torch.ones(2, requires_grad=True) for _ in range(3)]
    with use_allocator(Arena()):
        out = default_collate(samples)
    assert out.requires_grad and out.grad_fn is not None
    assert torch.equal(out, torch_collate(samples))


def test_meta_tensors_are_stacked_in_place() -> None:
    samples = [torch.empty(2, 3, device="meta") for _ in range(2)]
    with use_allocator(Arena()):
        out = default_collate(samples)
    assert out.device.type == "meta" and out.shape == (2, 2, 3)


# ------------------------------------------------------------------------------ errors


def test_unsupported_type_names_the_type_and_the_value() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<the opaque one>"

    err = raises_like_torch([{"x": [Opaque()]}, {"x": [Opaque()]}])
    message = str(err)
    assert message.startswith(
        "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; "
        "found <class 'test_collate_unit.test_unsupported_type_names_the_type_and_the_value."
        "<locals>.Opaque'>"
    )
    assert "['x'][0]" in message and "<the opaque one>" in message


@pytest.mark.parametrize("dtype", ["<U3", "S3", "O"])
def test_numpy_arrays_of_str_or_objects_raise_type_error(dtype: str) -> None:
    err = raises_like_torch([np.array(["a", "b"], dtype=dtype)] * 2)
    assert isinstance(err, TypeError) and str(err).startswith("default_collate: batch must")


def test_unequal_sequences_raise_like_torch() -> None:
    err = raises_like_torch([{"ids": [1, 2]}, {"ids": [1]}])
    assert isinstance(err, RuntimeError)
    assert "each element in list of batch should be of equal size" in str(err)
    assert "['ids']" in str(err) and "[2, 1]" in str(err)


def test_unequal_tensor_shapes_raise_like_torch() -> None:
    for alloc in (None, Arena()):
        with use_allocator(alloc):
            err = raises_like_torch([torch.zeros(2), torch.zeros(3)])
        assert "stack expects each tensor to be equal size" in str(err)


def test_a_sample_without_a_key_is_named_with_what_the_first_had() -> None:
    """torch raises a bare KeyError('x'); ours is a KeyError too, and says which sample lacks
    which key, and the keys of the first sample and of that one (issue 36)."""
    samples = [{"x": 1, "y": 2}, {"x": 3, "y": 4}, {"y": 5, "z": 6}]
    err = raises_like_torch(samples)
    assert isinstance(err, CollateKeyError) and isinstance(err, KeyError)
    assert (err.key, err.position, err.first_keys, err.sample_keys, err.sample) == (
        "x", 2, ["x", "y"], ["y", "z"], None)
    assert str(err).startswith("sample 2 of the batch has no key 'x' at the top level, "
                               "which the first sample has: the first sample's keys are "
                               "['x', 'y'], this one's ['y', 'z']"), str(err)
    named = err.with_sample(17)
    assert str(named).startswith("sample 2 of the batch (index 17) has no key 'x'")
    again = pickle.loads(pickle.dumps(named))  # crosses from a worker as itself
    assert type(again) is CollateKeyError and str(again) == str(named)


def test_a_nested_sample_without_a_key_says_where_and_padding_does_too() -> None:
    samples = [{"meta": {"id": 1, "len": [1]}}, {"meta": {"len": [2, 3]}}]
    for collate in (default_collate, PadCollate()):
        with pytest.raises(CollateKeyError) as info:
            collate(samples)
        assert str(info.value).startswith("sample 1 of the batch has no key 'id' at ['meta']")


def test_extra_keys_in_later_samples_are_dropped_like_torch() -> None:
    """Only a key the first sample has and another lacks is an error: torch's rule."""
    ours, theirs = both([{"x": 1}, {"x": 2, "extra": 3}])
    assert_same(ours, theirs)


def test_mixed_number_types_raise_like_torch() -> None:
    raises_like_torch([1, "a"])
    raises_like_torch([torch.zeros(2), 3])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_sparse_and_nested_tensors_raise_like_torch() -> None:
    err = raises_like_torch([torch.eye(2).to_sparse()] * 2)
    assert "sparse" in str(err)
    nt = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert "nested" in str(raises_like_torch([nt, nt]))


def test_empty_batch_raises_index_error_like_torch() -> None:
    raises_like_torch([])


# ------------------------------------------------------------------------------ allocator


def test_no_allocator_means_plain_tensors() -> None:
    out = default_collate([torch.zeros(3), torch.ones(3)])
    assert out.is_contiguous() and out.untyped_storage().nbytes() == out.nbytes
    t = new_tensor((2, 3), torch.int16)
    assert t.shape == (2, 3) and t.dtype == torch.int16 and t.device.type == "cpu"


def test_allocator_receives_every_stacked_output() -> None:
    arena = Arena()
    samples = [
        {"img": torch.full((3, 4, 4), i, dtype=torch.uint8), "arr": np.full((2,), i), "n": i}
        for i in range(5)
    ]
    with use_allocator(arena):
        out = default_collate(samples)
        assert new_tensor((1,), torch.float32).data_ptr() >= arena.buffer.data_ptr()
    assert arena.owns(out["img"]) and arena.owns(out["arr"])
    assert ((5, 3, 4, 4), torch.uint8) in arena.calls and ((5, 2), torch.int64) in arena.calls
    assert_same(out, torch_collate(samples))
    # the context is restored on exit
    assert not arena.owns(default_collate([torch.zeros(2)] * 2))


def test_allocator_is_restored_after_an_error() -> None:
    arena = Arena()
    with pytest.raises(TypeError), use_allocator(arena):
        default_collate([object()])
    assert not arena.owns(new_tensor((4,), torch.float32))


def test_mixed_dtypes_are_promoted_not_cast_into_the_allocator() -> None:
    samples = [torch.tensor([0.1], dtype=torch.float32), torch.tensor([0.1], dtype=torch.float64)]
    with use_allocator(Arena()):
        out = default_collate(samples)
    assert_same(out, torch_collate(samples))


# ------------------------------------------------------------------------------ PadCollate


def test_pad_known_values() -> None:
    out = PadCollate(pad_value=0)([{"ids": [1]}, {"ids": [2, 3, 4]}, {"ids": [5, 6]}])
    assert out["ids"].dtype == torch.int64
    assert out["ids"].tolist() == [[1, 0, 0], [2, 3, 4], [5, 6, 0]]
    out = PadCollate(pad_value=-100)([torch.tensor([1.5, 2.5]), torch.tensor([3.5])])
    assert out.dtype == torch.float32 and out.tolist() == [[1.5, 2.5], [3.5, -100.0]]


def test_pad_infers_the_dtype_torch_infers() -> None:
    pc = PadCollate(pad_value=-1)
    assert pc([[1.5], [1, 2]]).dtype == torch.float32
    assert PadCollate()([[True], [False, True]]).tolist() == [[True, False], [False, True]]
    assert pc([[np.int16(1)], [2, 3]]).dtype == torch.tensor([np.int16(1), 2]).dtype
    assert pc([[], [1, 2]]).tolist() == [[-1, -1], [1, 2]]


@pytest.mark.parametrize("rows", [
    [[1, 2, 3], [4]],
    [[0.1, 1e-50], [1e40, float("inf"), -0.0]],
    [[1, 2.5], [3]],  # ints and floats: the default float dtype
    [[True], [False, True]],
    [[True, 2], [3]],  # bools among ints: int64
    [[2**62, -(2**63)], [1]],
    [[np.float64(2.0), 1.0], [3.0]],  # one numpy float64 makes the whole float64
    [[1 + 2j], [3, 4]],
])
@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_pad_lists_give_torch_tensor_values_and_dtype(rows: list[list[Any]],
                                                       default: torch.dtype) -> None:
    # The fast path (ints, or ints and floats, through a C array) must be torch.tensor's
    # values and dtype to the bit, whatever the default dtype.
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        out = PadCollate(pad_value=0)(rows)
        want = torch.tensor([v for row in rows for v in row])
    finally:
        torch.set_default_dtype(before)
    got = out[torch.arange(out.shape[1]) < torch.tensor([[len(r)] for r in rows])]
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("samples", [
    [1, 2, 3], [2**62, -(2**63)], [True, False], [True, 2], [np.int64(3), 4],
    [1.5, 2.0], [1.5, 2], [0.1, 1e-50, float("inf"), -0.0], [np.float64(2.0), 1.0],
])
def test_numbers_collate_to_torch_values_and_dtype(samples: list[Any]) -> None:
    out, want = default_collate(samples), torch_collate(samples)
    assert out.dtype == want.dtype and torch.equal(out, want)
    out.resize_(8)  # a tensor of its own, as torch's is


def test_pad_lists_beyond_int64_fail_as_torch_does() -> None:
    with pytest.raises(TypeError, match="cannot pad"):
        PadCollate()([[2**63, 1], [1]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.uint8])
def test_pad_keeps_tensor_dtype(dtype: torch.dtype) -> None:
    out = PadCollate(pad_value=7)([torch.ones(1, dtype=dtype), torch.ones(3, dtype=dtype)])
    assert out.dtype == dtype
    assert out.tolist() == [[1, 7, 7], [1, 1, 1]]


def test_pad_numpy_arrays_like_tensors() -> None:
    out = PadCollate()([np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int32)])
    assert out.dtype == torch.int32 and out.tolist() == [[1, 2], [3, 0]]


def test_pad_nested_and_mixed_fields() -> None:
    samples = [
        {"ids": [i] * (i + 1), "label": i, "name": f"n{i}", "x": (torch.arange(i + 1), i)}
        for i in range(3)
    ]
    out = PadCollate(pad_value=9)(samples)
    assert out["ids"].tolist() == [[0, 9, 9], [1, 1, 9], [2, 2, 2]]
    assert_same(out["label"], torch.tensor([0, 1, 2]))
    assert out["name"] == ["n0", "n1", "n2"]
    assert out["x"][0].tolist() == [[0, 9, 9], [0, 1, 9], [0, 1, 2]]


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_pad_is_the_default_when_nothing_is_ragged(kind: str) -> None:
    samples = [SAMPLES[kind](i) for i in range(4)]
    assert_same(PadCollate()(samples), torch_collate(samples), kind)


def test_pad_goes_through_the_allocator() -> None:
    arena = Arena()
    with use_allocator(arena):
        lists = PadCollate(pad_value=-1)([[1, 2], [3]])
        tensors = PadCollate(pad_value=-1)([torch.tensor([1.0]), torch.tensor([2.0, 3.0])])
    assert arena.owns(lists) and arena.owns(tensors)
    assert lists.tolist() == [[1, 2], [3, -1]] and tensors.tolist() == [[1.0, -1.0], [2.0, 3.0]]


def test_pad_lists_of_str_are_left_to_the_default() -> None:
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal"):
        PadCollate()([{"w": ["a"]}, {"w": ["b", "c"]}])
    assert PadCollate()([["a", "b"], ["c", "d"]]) == default_collate([["a", "b"], ["c", "d"]])


def test_pad_errors_name_the_bad_value() -> None:
    with pytest.raises(TypeError, match=re.escape("at ['ids']: sample 1, item 1 is a str ('x')")):
        PadCollate()([{"ids": [1]}, {"ids": [2, "x"]}])
    with pytest.raises(ValueError, match=re.escape("sample 1 is a tensor of shape (2, 2)")):
        PadCollate()([torch.zeros(3), torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"pad_value -100 does not fit the torch\.uint8 values"):
        PadCollate(pad_value=-100)(
            [torch.zeros(1, dtype=torch.uint8)] * 2 + [torch.zeros(2, dtype=torch.uint8)]
        )
    with pytest.raises(ValueError, match=r"pad_value 0\.5 does not fit the torch\.int64"):
        PadCollate(pad_value=0.5)([[1], [1, 2]])
    with pytest.raises(TypeError, match="pad_value must be an int or a float"):
        PadCollate(pad_value="0")  # type: ignore[arg-type]


def test_pad_collate_pickles_and_reprs() -> None:
    pc = pickle.loads(pickle.dumps(PadCollate(pad_value=5)))
    assert pc == PadCollate(pad_value=5) and repr(pc) == "PadCollate(pad_value=5)"
    assert pc([[1], [2, 3]]).tolist() == [[1, 5], [2, 3]]


# ------------------------------------------------------------- a copy helper (fetch thread)


class _Counting(concurrent.futures.ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.calls = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


def _with_helper(helper: concurrent.futures.Executor, collate: Callable[[], Any],
                 waiting: ConsumerWaits | None = None) -> Any:
    """``collate()`` in a context whose thread has ``helper`` (the fetch thread's set-up),
    put back after it."""

    def run() -> Any:
        copy_helper(helper, waiting)
        try:
            with use_allocator(Recycler()):
                return collate()
        finally:
            copy_helper(None)

    return contextvars.copy_context().run(run)


def _permuted_images(n: int, start: int = 0) -> list[dict[str, Any]]:
    """HWC pixels seen as CHW, as ``pil_to_tensor``-style datasets hand them over."""
    return [{"image": torch.arange(224 * 224 * 3, dtype=torch.int32).add(start + i)
             .to(torch.uint8).view(224, 224, 3).permute(2, 0, 1), "label": i}
            for i in range(n)]


def test_a_large_stack_is_shared_with_the_helper_and_is_the_same_batch() -> None:
    samples = _permuted_images(64)
    assert SPLIT_BYTES <= 64 * 3 * 224 * 224
    with _Counting() as helper:
        batch = _with_helper(helper, lambda: default_collate(samples))
        assert helper.calls == 1
        small = _with_helper(helper, lambda: default_collate(samples[:8]))
        assert helper.calls == 1  # under SPLIT_BYTES: all of it here
    assert_same(batch, torch_collate(samples))
    assert_same(small, torch_collate(samples[:8]))


def test_the_helper_is_asked_only_while_the_consumer_waits() -> None:
    """A batch built ahead, while the consumer's own step may hold every core, is copied
    by this thread alone: a chunk the idle-priority helper began would wait for that step."""
    samples = _permuted_images(64)
    waiting = ConsumerWaits(now=False)
    with _Counting() as helper:
        ahead = _with_helper(helper, lambda: default_collate(samples), waiting)
        assert helper.calls == 0
        waiting.now = True
        awaited = _with_helper(helper, lambda: default_collate(samples), waiting)
        assert helper.calls == 1
    assert_same(ahead, torch_collate(samples))
    assert_same(awaited, torch_collate(samples))


def test_a_stack_that_fails_in_a_chunk_fails_as_torch_stack_does() -> None:
    samples = _permuted_images(64)
    samples[40]["image"] = samples[40]["image"][:, :100]
    with _Counting() as helper, pytest.raises(RuntimeError, match=r"stack expects each tensor "
                                                                   r".*\['image'\]"):
        _with_helper(helper, lambda: default_collate(samples))


def test_a_helper_that_never_gets_a_core_leaves_the_whole_stack_to_this_thread() -> None:
    """The helper runs at the lowest priority: a busy machine may not run it at all."""
    samples = _permuted_images(64)
    with _Counting() as helper:
        busy = threading.Event()
        helper.submit(busy.wait)  # its one thread is taken: our chunks would queue behind
        try:
            batch = _with_helper(helper, lambda: default_collate(samples))
        finally:
            busy.set()
        assert helper.calls == 2
    assert_same(batch, torch_collate(samples))
