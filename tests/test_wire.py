"""Round trips: wire messages and the batch codec through a real arena (hypothesis)."""

from __future__ import annotations

import gc
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader.plane import _wire as wire
from aioloader.plane._arena import ArenaMap, Lease, SlotFull, SlotWriter, create_file
from aioloader.plane._codec import Copied, decode, encode

messages = st.one_of(
    st.builds(wire.Release, st.integers(0, 64)),
    st.builds(wire.Task, st.integers(0, 2**40), st.lists(st.integers(0, 2**40), max_size=50)),
    st.builds(wire.PassEnd, st.integers(0, 64), st.integers(0, 2**31), st.integers(0, 2**31)),
    st.builds(wire.Failed, st.text(), st.text(), st.none() | st.binary()),
    st.builds(wire.Arena, st.integers(1, 64), st.integers(1, 2**40)),
    st.builds(wire.BatchFailed, st.integers(0, 2**31), st.text(), st.text(),
              st.none() | st.binary(), st.none() | st.integers(0, 64),
              st.none() | st.lists(st.integers(0, 2**31), max_size=4)),
    st.builds(wire.Rewind, st.integers(0, 2**31)),
    st.builds(wire.Rewound, st.integers(0, 2**31)),
)


@given(st.lists(messages, max_size=20), st.integers(1, 64))
def test_frames_cut_anywhere_give_back_the_messages(msgs, cut):
    stream = b"".join(wire.encode(m) for m in msgs)
    reader = wire.FrameReader()
    got = []
    for i in range(0, len(stream), cut):
        got += reader.feed(stream[i:i + cut])
    assert got == msgs


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 7).reshape(shape)
    t = t.to(dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() \
    | st.binary()
trees = st.recursive(
    scalars | tensors(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4),
    max_leaves=12)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_batch_trees_survive_the_arena(tree):
    fd = create_file(2 * 65536, "aioloader-test")
    try:
        arena = ArenaMap(fd, 2, 65536)
        receiver = ArenaMap(fd, 2, 65536)
    finally:
        os.close(fd)
    try:
        encoded = encode(tree, SlotWriter(arena, 1))
        message = wire.decode(wire.encode(wire.Batch(1, 0, 0, encoded))[4:])
        assert isinstance(message, wire.Batch)
        assert _same(decode(message.tree, Copied(receiver)), tree)
        returned: list[int] = []
        leased = decode(message.tree, Lease(receiver, 1, lambda: returned.append(1)))
        assert _same(leased, tree)
        del leased
        if not returned:  # views in a reference cycle wait for the collector (~0.1 s a run)
            gc.collect()
        assert returned == [1], "a leased slot comes back once its views are gone"
    finally:
        arena.close()
        receiver.close()


def test_a_batch_larger_than_its_slot_says_how_much_it_needs():
    fd = create_file(65536, "aioloader-test")
    try:
        arena = ArenaMap(fd, 1, 65536)
    finally:
        os.close(fd)
    big = torch.zeros(100_000, dtype=torch.uint8)
    try:
        encode({"a": big, "b": big.clone()}, SlotWriter(arena, 0))
        raise AssertionError("expected SlotFull")
    except SlotFull as full:
        assert full.needed >= 200_000
    finally:
        arena.close()


def test_a_failure_whose_text_holds_surrogates_is_still_reported():
    # str(exc) of ValueError(f"bad file {name}") keeps an undecodable name's surrogates
    msg = wire.Failed("ValueError('caf\\udce9.jpg')", "ValueError: bad file caf\udce9.jpg\n",
                      b"pickled")
    got = wire.FrameReader().feed(wire.encode(msg))
    assert got == [wire.Failed(msg.error_repr, "ValueError: bad file caf\\udce9.jpg\n",
                               b"pickled")]
