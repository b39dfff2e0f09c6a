"""The batch codec carries every picklable value as itself, its tensors through the arena.

Each batch goes the whole way: encoded into a real arena slot, packed and unpacked with
msgpack's defaults, decoded from a second mapping of the same arena.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import gc
import os
import pickle
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader import FrameTooLargeError
from aioloader.plane import _wire as wire
from aioloader.plane._arena import ArenaMap, SlotFull, SlotWriter, align, create_file
from aioloader.plane._codec import Copied, decode, encode, tensors_nbytes

SLOT = 1 << 20


class Arena:
    """A worker's mapping and the parent's mapping of one arena file."""

    def __init__(self, slot_size: int = SLOT, slots: int = 1) -> None:
        fd = create_file(slots * slot_size, "aioloader-test")
        try:
            self.worker = ArenaMap(fd, slots, slot_size)
            self.parent = ArenaMap(fd, slots, slot_size)
        finally:
            os.close(fd)
        self.made: list[torch.Tensor] = []  # every tensor decode asked the arena for

    def writer(self) -> SlotWriter:
        return SlotWriter(self.worker, 0)

    def __call__(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A view of the parent's mapping (decode's ``TensorAt``), kept for :meth:`owns`."""
        t = self.parent.view(offset, dtype, shape)
        self.made.append(t)
        return t

    def read(self, offset: int, n: int) -> bytes:
        return self.parent.read(offset, n)

    def round_trip(self, batch: Any, *, views: bool = False) -> Any:
        """``batch`` encoded, through msgpack (default options) and decoded."""
        tree = encode(batch, self.writer())
        unpacked = msgpack.unpackb(msgpack.packb(tree, use_bin_type=True), raw=False,
                                   strict_map_key=False)
        return decode(unpacked, self if views else Copied(self.parent))

    def owns(self, t: torch.Tensor) -> bool:
        """``t`` is one of the views decode made of this arena (not a pickled copy)."""
        base = self.parent.base_ptr
        return (any(t is m for m in self.made)
                and base <= t.data_ptr() < base + self.parent.slots * self.parent.slot_size)

    def close(self) -> None:
        if self.made:  # views the test still holds in cycles would keep the mapping
            self.made.clear()
            gc.collect()
        self.worker.close()
        self.parent.close()


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena()
    try:
        yield a
    finally:
        a.close()


def same(a: Any, b: Any) -> bool:
    """Equal and of the same type all the way down (tensors: dtype, shape, values, grad)."""
    if type(a) is not type(b):
        return False
    if a is b:  # singletons: None, enum members
        return True
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                and a.requires_grad == b.requires_grad)
    if isinstance(a, Mapping):
        return (len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
                and all(same(a[k], b[k]) for k in a) and same_attrs(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return same_attrs(a, b)
    return bool(a == b) and same_attrs(a, b)


def same_attrs(a: Any, b: Any) -> bool:
    names = [f.name for f in dataclasses.fields(a)] if dataclasses.is_dataclass(a) else []
    da, db = getattr(a, "__dict__", {}), getattr(b, "__dict__", {})
    return (all(same(getattr(a, n), getattr(b, n)) for n in names)
            and list(da) == list(db) and all(same(da[k], db[k]) for k in da))


def leaves(tree: Any) -> Iterator[Any]:
    if type(tree) is list:
        for v in tree:
            yield from leaves(v)
    else:
        yield tree


# ------------------------------------------------------------------ strings

SURROGATE = "caf\udce9.jpg"  # os.fsdecode(b"caf\xe9.jpg") on a UTF-8 system


def test_strings_with_surrogate_escapes_come_back_exactly(arena):
    batch = {
        "path": [SURROGATE, "plain.jpg", "naïve €", "\ud83d\ude00 as two lone halves", ""],
        SURROGATE: "a key with an undecodable byte",
        ("tuple", "\udcff"): "\udc80" * 3,
        "nested": {"deeper": ["\udce9"]},
    }
    got = arena.round_trip(batch)
    assert same(got, batch)
    assert got[SURROGATE] == "a key with an undecodable byte"


def test_valid_strings_stay_bare_and_only_surrogates_get_a_tag(arena):
    tree = encode({"ascii": "a.jpg", "utf8": "café", "bad": SURROGATE}, arena.writer())
    assert "a.jpg" in leaves(tree) and "café" in leaves(tree)
    assert SURROGATE not in leaves(tree)
    assert ["s", SURROGATE.encode("utf-8", "surrogatepass")] in tree[1]


def test_a_collated_batch_of_undecodable_file_names(arena):
    from torch.utils.data import default_collate

    names = [os.fsdecode(b"img_%d_\xe9\xff.jpg" % i) for i in range(8)]
    batch = default_collate([{"path": n, "x": torch.tensor([i])} for i, n in enumerate(names)])
    assert same(arena.round_trip(batch), batch)


# ------------------------------------------------------------------ tensors

def test_tensors_of_every_shape_and_layout(arena):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    batch = {
        "scalar": torch.tensor(3.5),
        "int_scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, dtype=torch.int16),
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.tensor([1, 2]).expand(3, 2),
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "neg": torch.tensor([1.0, 2.0])._neg_view(),
        "bool": torch.tensor([True, False]),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "grad": torch.ones(2, requires_grad=True),
    }
    got = arena.round_trip(batch)
    expected = {k: v.detach().resolve_conj().resolve_neg().contiguous().requires_grad_(
        v.requires_grad) for k, v in batch.items()}
    assert same(got, expected)


@pytest.mark.deadline(60)
def test_a_64_mb_tensor():
    big = torch.arange(16 << 20, dtype=torch.int32)  # 64 MiB
    a = Arena(slot_size=big.numel() * 4 + (1 << 16))
    try:
        got = a.round_trip({"big": big, "label": 1}, views=True)
        assert a.owns(got["big"]) and torch.equal(got["big"], big)
        del got
    finally:
        a.close()


def test_tensors_the_collate_wrote_into_the_slot_are_not_copied_again(arena):
    writer = arena.writer()
    t = writer.alloc([4, 4], torch.float32)
    t.copy_(torch.eye(4))
    tree = encode({"x": t}, writer)
    assert writer.pos - writer.start == 64  # the one allocation, no copy
    assert tree[1][1][1] == t.data_ptr() - arena.worker.base_ptr


# ------------------------------------------------------------------ numbers and subclasses

class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Flag(enum.Enum):
    ON = "on"


class Name(str):
    pass


class Ratio(float):
    pass


@pytest.mark.parametrize("views", [False, True])
def test_large_bytes_travel_in_the_slot_and_come_back_as_bytes(arena, views):
    # A raw WebDataset sample: its JPEG bytes go through the arena, not the header; short
    # bytes stay in the header, bare.
    big, small = bytes(range(256)) * 40, b"label 3"
    batch = {"jpg": [big, big[::-1]], "cls": [small, small], "__key__": ["a", "b"]}
    tree = encode(batch, arena.writer())
    packed = msgpack.packb(tree, use_bin_type=True)
    assert big not in packed and small in packed
    assert tensors_nbytes(batch) == 2 * align(len(big))
    got = arena.round_trip(batch, views=views)
    assert same(got, batch)
    arena.worker.bytes.fill_(0)  # the consumer's bytes are its own, not the slot's
    assert got["jpg"][0] == big


def test_bytes_that_do_not_fit_say_how_much_the_batch_needs():
    a = Arena(slot_size=1 << 16)
    try:
        with pytest.raises(SlotFull) as full:
            encode([b"x" * (1 << 15)] * 3, a.writer())
        assert full.value.needed == 3 * align(1 << 15)
    finally:
        a.close()


def test_numbers_and_subclasses_keep_their_exact_type(arena):
    batch = {
        "int64_bounds": [-(1 << 63), (1 << 63) - 1],
        "huge": [1 << 63, -(1 << 63) - 1, 10 ** 40, -(10 ** 40)],
        "enum": [Color.RED, Color.GREEN, Flag.ON],
        "bool": [True, False],
        "str_subclass": Name("sub"),
        "float_subclass": Ratio(0.5),
        "floats": [float("inf"), -0.0, 1e-300],
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"ab"),
        "set": {1, 2},
        "none": None,
    }
    got = arena.round_trip(batch)
    assert same(got, batch)
    assert type(got["enum"][0]) is Color and type(got["str_subclass"]) is Name


def test_an_unpicklable_value_is_a_type_error_that_names_it(arena):
    with pytest.raises(TypeError, match=r"_thread\.lock"):
        encode({"lock": threading.Lock()}, arena.writer())


# ------------------------------------------------------------------ UserDict

class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding without a __getstate__: extra attributes."""

    def __init__(self, data: dict[str, Any], encodings: Any = None, n: int | None = None):
        super().__init__(data)
        self._encodings = encodings
        self._n_sequences = n


class BatchEncodingLike(collections.UserDict):
    """transformers' BatchEncoding: attribute access reads ``data``, and its own pickle
    state (data and encodings, not ``_n_sequences``)."""

    def __init__(self, data: dict[str, Any], encoding: Any = None, n: int | None = None):
        super().__init__(data)
        self._encodings = encoding
        self._n_sequences = n

    def __getattr__(self, item: str) -> Any:
        try:
            return self.data[item]
        except KeyError:
            raise AttributeError from None

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data, "encodings": self._encodings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "data" in state:
            self.data = state["data"]
        if "encodings" in state:
            self._encodings = state["encodings"]


def test_a_user_dict_keeps_its_type_its_attributes_and_its_tensors_in_the_arena(arena):
    batch = Encoding({"input_ids": torch.arange(12).reshape(3, 4), "names": ["a", SURROGATE]},
                     encodings=[{"offsets": torch.ones(3, 2)}, None], n=2)
    got = arena.round_trip(batch, views=True)
    assert type(got) is Encoding and same(got, batch)
    assert got._n_sequences == 2
    assert arena.owns(got["input_ids"]) and arena.owns(got._encodings[0]["offsets"])
    got["new"] = 1  # still a working mapping
    assert got.data["new"] == 1


def test_a_batch_encoding_round_trips_as_pickle_would_rebuild_it(arena):
    batch = BatchEncodingLike({"input_ids": torch.ones(2, 3, dtype=torch.int64),
                               "attention_mask": torch.ones(2, 3, dtype=torch.int64)},
                              encoding=["enc0", "enc1"], n=1)
    got = arena.round_trip(batch, views=True)
    assert type(got) is BatchEncodingLike
    assert list(got) == ["input_ids", "attention_mask"]
    assert same(got.input_ids, batch.input_ids) and arena.owns(got["input_ids"])
    assert got._encodings == ["enc0", "enc1"]
    expected = pickle.loads(pickle.dumps(batch))
    assert vars(got).keys() == vars(expected).keys()  # what torch's DataLoader delivers


def test_user_dicts_nested_in_containers(arena):
    batch = [Encoding({"x": torch.zeros(2)}), {"enc": Encoding({"y": (torch.ones(1),)})}]
    got = arena.round_trip(batch, views=True)
    assert same(got, batch)
    assert arena.owns(got[0]["x"]) and arena.owns(got[1]["enc"]["y"][0])


# ------------------------------------------------------------------ dataclasses

@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Inner:
    ids: torch.Tensor
    lengths: list[int]


@dataclasses.dataclass
class Outer:
    inner: Inner
    images: list[torch.Tensor]
    meta: dict[str, Any]
    total: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.total = sum(self.inner.lengths)


@dataclasses.dataclass(slots=True)
class Slotted:
    x: torch.Tensor
    n: int


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlotted:
    x: torch.Tensor
    tag: str


def test_a_frozen_dataclass(arena):
    batch = Frozen(torch.arange(6).reshape(2, 3), SURROGATE)
    got = arena.round_trip(batch, views=True)
    assert type(got) is Frozen and same(got, batch) and arena.owns(got.x)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.label = "changed"


def test_a_dataclass_holding_a_dataclass_and_a_list_of_tensors(arena):
    batch = Outer(Inner(torch.ones(2, 5, dtype=torch.int64), [5, 3]),
                  [torch.rand(3, 4, 4), torch.rand(3, 2, 2)], {"source": "x"})
    batch.note = "an attribute that is not a field"
    got = arena.round_trip(batch, views=True)
    assert type(got) is Outer and type(got.inner) is Inner and same(got, batch)
    assert got.total == 8 and got.note == batch.note
    assert arena.owns(got.inner.ids) and all(arena.owns(t) for t in got.images)


@pytest.mark.parametrize("cls", [Slotted, FrozenSlotted])
def test_dataclasses_with_slots(arena, cls):
    batch = cls(torch.arange(3), 4 if cls is Slotted else "t")
    got = arena.round_trip(batch, views=True)
    assert type(got) is cls and same(got, batch) and arena.owns(got.x)


def test_tensors_nbytes_counts_the_tensors_inside_objects():
    batch = {"enc": Encoding({"a": torch.zeros(1000)}, encodings=torch.zeros(1000)),
             "dc": Outer(Inner(torch.zeros(1000), [1]), [torch.zeros(1000)], {})}
    need = tensors_nbytes(batch)
    assert need >= 4 * 4000
    a = Arena(slot_size=need)  # a slot sized by it holds the batch
    try:
        assert same(a.round_trip(batch), batch)
    finally:
        a.close()
    small = Arena(slot_size=need // 2)
    try:
        with pytest.raises(SlotFull) as full:
            encode(batch, small.writer())
        assert full.value.needed == need
    finally:
        small.close()


def test_tensors_nbytes_counts_tensors_among_leaves_keys_and_mappings():
    t, u = torch.zeros(100), torch.zeros(3, dtype=torch.uint8)
    batch = [1, "a", None, t, (2.0, b"x", [u, True]),
             {"k": t, 3: u, t: "a tensor key"}, collections.UserDict({"v": u})]
    assert tensors_nbytes(batch) == 3 * align(t.nbytes) + 3 * align(u.nbytes)
    assert tensors_nbytes([1] * 64) == tensors_nbytes({"a": "b"}) == 0


def test_a_local_class_falls_back_to_pickle_and_says_why_when_that_fails(arena):
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(TypeError, match="Local"):
        encode({"v": Local(1)}, arena.writer())


# ------------------------------------------------------------------ other containers

class Point(NamedTuple):
    x: torch.Tensor
    label: str


class Plain(dict):
    pass


def test_namedtuples_and_mappings_keep_their_type(arena):
    with_attr = Plain(a=1)
    with_attr.note = "kept"
    batch = {
        "point": Point(torch.ones(2), SURROGATE),
        "ordered": collections.OrderedDict([("b", torch.zeros(1)), ("a", 2)]),
        "plain": Plain(x=torch.ones(1)),
        "with_attr": with_attr,
        "default": collections.defaultdict(list, {"k": [1]}),
        "counter": collections.Counter("aab"),
        "frozenset": frozenset({1}),
    }
    got = arena.round_trip(batch, views=True)
    assert same(got, batch)
    assert got["with_attr"].note == "kept" and got["default"].default_factory is list
    assert arena.owns(got["point"].x) and arena.owns(got["ordered"]["b"])


def test_deep_nesting_still_packs(arena):
    deep: Any = torch.ones(1)
    for i in range(150):  # past the depth from which the codec pickles the batch whole
        deep = [deep] if i % 2 else {"k": deep}
    assert same(arena.round_trip(deep), deep)


def test_a_batch_that_holds_itself_comes_back_with_its_cycle(arena):
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    dc = Outer(Inner(torch.zeros(1), [1]), [], {})
    dc.meta["self"] = dc
    got_loop, got_dc = arena.round_trip([loop, dc])
    assert got_loop[1] is got_loop and torch.equal(got_loop[0], loop[0])
    assert got_dc.meta["self"] is got_dc


# ------------------------------------------------------------------ property

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(st.characters(codec=None, categories=["L", "N", "Cs", "So"]), max_size=6)
           | st.binary(max_size=8) | st.sampled_from([Color.RED, Name("n"), Ratio(2.0)]))
TENSORS = st.builds(lambda n, t: torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
                    [:, ::t], st.integers(0, 3), st.integers(1, 2))
VALUES = st.recursive(
    SCALARS | TENSORS,
    lambda inner: (st.lists(inner, max_size=3) | st.tuples(inner, inner)
                   | st.dictionaries(SCALARS, inner, max_size=3)
                   | st.builds(Point, TENSORS, st.text(max_size=3))
                   | st.builds(lambda d: Encoding(d, n=1),
                               st.dictionaries(st.text(max_size=3), inner, max_size=3))
                   | st.builds(Inner, TENSORS, st.lists(st.integers(), max_size=3))),
    max_leaves=10)


@settings(max_examples=150, deadline=None)
@given(VALUES)
def test_any_batch_packs_and_comes_back_as_itself(batch):
    a = Arena(slot_size=1 << 16)
    try:
        tree = encode(batch, a.writer())
        msgpack.packb(tree, use_bin_type=True)  # never fails
        got = a.round_trip(batch)
        assert same(got, batch), f"{got!r} != {batch!r}"
    finally:
        a.close()


# ------------------------------------------------------------------ frame sizes

def test_a_message_over_the_frame_limit_says_what_to_do(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME", 1000)
    wire.encode(wire.Batch(0, 7, 0, ["l", ["x" * 500]]))  # under the limit
    tree = ["l", ["x" * 2000]]
    size = len(msgpack.packb([wire.Batch.TAG, 0, 7, 0, tree, None, 0.0],
                             use_bin_type=True))
    with pytest.raises(FrameTooLargeError) as err:
        wire.encode(wire.Batch(0, 7, 0, tree))
    text = str(err.value)
    assert "batch 7" in text and f"takes {size} bytes" in text and "limit of 1000" in text
    assert "put large data in tensors" in text
    with pytest.raises(FrameTooLargeError, match="Task message takes"):
        wire.encode(wire.Task(1, list(range(1000))))


def test_a_length_prefix_over_the_limit_is_a_corrupt_stream(monkeypatch):
    with pytest.raises(FrameTooLargeError, match="corrupt"):
        wire.FrameReader().feed(b"\xff\xff\xff\xff")  # 4 GiB: over the default limit
    monkeypatch.setattr(wire, "MAX_FRAME", 1000)
    reader = wire.FrameReader()
    assert reader.feed(wire.encode(wire.Release(3))) == [wire.Release(3)]
    assert reader.feed((1000).to_bytes(4, "big")) == []  # at the limit: waits for the rest
    reader = wire.FrameReader()
    with pytest.raises(FrameTooLargeError, match="1001 bytes"):
        reader.feed((1001).to_bytes(4, "big"))
