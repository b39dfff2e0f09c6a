"""Reused memory for batches built in this process (``aioloader.pipeline._recycle``, issue 23): a
buffer goes back only once nothing of its tensor is left, wherever that is dropped; batches
a user keeps never change; each large tensor has a storage of its own size."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import io
import threading
from collections import UserDict
from typing import Any

import pytest
import torch

import aioloader
from aioloader.pipeline._collate import default_collate
from aioloader.pipeline._recycle import KEEP, MIN_BYTES, Recycler
from aioloader.pipeline._stacking import use_allocator

LARGE = (3, 224, 224)  # 150 KB of uint8: 64 of them make a 9.6 MB batch


def images(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"image": torch.full(LARGE, (start + i) % 251, dtype=torch.uint8), "label": start + i}
            for i in range(n)]


def collate(memory: Recycler, samples: list[Any]) -> Any:
    with use_allocator(memory):
        return default_collate(samples)


def test_a_dropped_batch_lends_its_memory_to_the_next() -> None:
    memory = Recycler()
    first = collate(memory, images(8))
    address = first["image"].data_ptr()
    assert memory.held() == 0  # lent out
    del first
    assert memory.held() >= 8 * 150_528
    second = collate(memory, images(8, start=8))
    assert second["image"].data_ptr() == address
    assert second["image"][:, 0, 0, 0].tolist() == list(range(8, 16))


def test_memory_of_a_kept_batch_is_never_lent_again() -> None:
    """Any view keeps it: a slice, a numpy array, a reshaped or sliced tensor."""
    memory = Recycler()
    kept: list[Any] = []
    for k, keep in enumerate([lambda b: b["image"][3], lambda b: b["image"].numpy(),
                              lambda b: b["image"].view(-1)[150_528 * 5:],
                              lambda b: UserDict(b)]):
        batch = collate(memory, images(8, start=10 * k))
        kept.append((k, keep(batch)))
        del batch
    for _ in range(6):  # later batches, dropped at once: buffers come and go meanwhile
        collate(memory, images(8, start=200))
    gc.collect()
    for k, view in kept:
        if k == 0:
            assert bool((view == 10 * k + 3).all())
        elif k == 1:
            assert view[:, 0, 0, 0].tolist() == list(range(10, 18))
        elif k == 2:
            assert bool((torch.as_tensor(view[:150_528]) == 25).all())
        else:
            assert view["image"][:, 0, 0, 0].tolist() == list(range(30, 38))


def test_a_large_tensor_has_a_storage_of_its_own_size() -> None:
    """Saving one tensor of a batch saves that tensor, not a slab of others."""
    memory = Recycler()
    batch = collate(memory, [{"a": torch.zeros(LARGE, dtype=torch.uint8),
                              "b": torch.ones(LARGE, dtype=torch.float32)}] * 4)
    for key, dtype in (("a", torch.uint8), ("b", torch.float32)):
        tensor = batch[key]
        assert tensor.dtype is dtype and tensor.shape == (4, *LARGE)
        assert tensor.untyped_storage().nbytes() == tensor.nbytes
    saved = io.BytesIO()
    torch.save(batch["a"], saved)
    assert saved.tell() < batch["a"].nbytes + 4096
    assert bool((batch["b"] == 1).all()) and bool((batch["a"] == 0).all())


def test_small_tensors_come_from_torch() -> None:
    memory = Recycler()
    labels = memory((MIN_BYTES // 8 - 1,), torch.int64)
    assert labels.untyped_storage().resizable()  # torch's own allocation
    assert memory.held() == 0
    del labels
    assert memory.held() == 0


def test_memory_dropped_in_another_thread_comes_back() -> None:
    memory = Recycler()
    batch = collate(memory, images(4))
    address = batch["image"].data_ptr()
    box = [batch]
    del batch
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert collate(memory, images(4))["image"].data_ptr() == address


def test_memory_of_a_batch_in_a_reference_cycle_comes_back_when_collected() -> None:
    """The garbage collector drops it, at whatever allocation it runs: the buffer comes back
    then, and the recycler is not left waiting on itself."""
    memory = Recycler()
    batch = collate(memory, images(4))
    address = batch["image"].data_ptr()
    batch["itself"] = batch  # a cycle: only the collector frees it
    del batch
    assert memory.held() == 0
    gc.collect()
    assert memory.held() >= 4 * 150_528
    assert collate(memory, images(4))["image"].data_ptr() == address


def test_it_keeps_a_bounded_number_of_free_buffers() -> None:
    memory = Recycler()
    batches = [collate(memory, images(2, start=k)) for k in range(KEEP + 3)]
    size = batches[0]["image"].untyped_storage().nbytes()
    del batches
    assert memory.held() <= KEEP * (size + (64 << 10))


def test_a_buffer_serves_only_tensors_near_its_size() -> None:
    """A 9.6 MB buffer does not hold a 300 KB tensor (pinning 9.6 MB for it)."""
    memory = Recycler()
    big = memory((64, *LARGE), torch.uint8)
    address = big.data_ptr()
    del big
    small = memory((2, *LARGE), torch.uint8)
    assert small.data_ptr() != address


def test_it_keeps_a_bounded_number_of_free_bytes() -> None:
    """A batch larger than the bound is not kept at all: freed, as torch's would be."""
    memory = Recycler(keep_bytes=3 * 8 * 150_528)
    batches = [collate(memory, images(8, start=k)) for k in range(5)]
    del batches
    assert 0 < memory.held() <= 3 * 8 * 150_528
    huge = collate(memory, images(32))
    del huge
    assert memory.held() <= 3 * 8 * 150_528


@dataclasses.dataclass
class Pair:
    image: torch.Tensor
    label: int


class Images:
    """A new tensor per sample, with a value that says which sample it is."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": torch.full(LARGE, i % 251, dtype=torch.uint8), "label": i}


def check(batches: list[Any], batch_size: int) -> None:
    """Every kept batch still holds its own samples."""
    for b, batch in enumerate(batches):
        image = batch.image if isinstance(batch, Pair) else batch["image"]
        first = [v % 251 for v in range(b * batch_size, (b + 1) * batch_size)]
        assert image[:, 0, 0, 0].tolist() == first
        assert bool((image == image[:, :1, :1, :1]).all())


@pytest.mark.parametrize("face", ["async", "sync"])
def test_batches_kept_by_the_user_stay_intact(face: str) -> None:
    """num_workers=0, both faces: list(loader) keeps every batch while later ones are built;
    the next epoch reuses only what the first one dropped."""
    loader = aioloader.DataLoader(Images(40), batch_size=8, quiet=True)

    async def epoch() -> list[Any]:
        return [batch async for batch in loader]

    def one() -> list[Any]:
        return asyncio.run(epoch()) if face == "async" else list(loader)

    try:
        kept = one()
        check(kept, 8)
        addresses = {b["image"].data_ptr() for b in kept}
        assert len(addresses) == 5  # nothing lent twice while kept
        again = one()
        check(again, 8)
        check(kept, 8)
        del kept
        gc.collect()
        third = one()  # the first epoch's memory is free now
        check(third, 8)
        assert {b["image"].data_ptr() for b in third} & addresses
    finally:
        loader.close()


def test_a_loop_that_drops_each_batch_cycles_through_few_buffers() -> None:
    loader = aioloader.DataLoader(Images(64 * 10), batch_size=64, quiet=True)
    try:
        seen = {int(batch["image"].data_ptr()) for batch in loader}
        assert len(seen) <= 3, seen  # the user's batch, the next one, one spare
    finally:
        loader.close()


def test_a_copy_helper_that_never_runs_holds_no_batch_memory() -> None:
    """The in-process copy helper runs at idle priority: on a busy machine it may not run
    for seconds, and the stacks it was offered are finished by the collating thread. Those
    offers, cancelled but still queued behind its thread, must not keep their batch's memory
    from coming back (CI: 5 buffers for a loop that drops each batch)."""
    import concurrent.futures

    from aioloader.pipeline._stacking import copy_helper

    memory = Recycler()
    helper = concurrent.futures.ThreadPoolExecutor(1)
    busy = threading.Event()
    helper.submit(busy.wait)  # its only thread is taken: every offer waits in its queue
    copy_helper(helper)
    try:
        seen = set()
        for k in range(6):
            batch = collate(memory, images(64, start=k))
            assert batch["image"][:, 0, 0, 0].tolist() == [(k + i) % 251 for i in range(64)]
            seen.add(batch["image"].data_ptr())
            del batch
        assert len(seen) == 1, seen
    finally:
        copy_helper(None)
        busy.set()
        helper.shutdown()


def pairs(samples: list[dict[str, Any]]) -> Pair:
    """A user's collate: torch's default_collate inside, a dataclass out."""
    from torch.utils.data import default_collate as torch_collate

    batch = torch_collate(samples)
    return Pair(batch["image"], int(batch["label"][0]))


@pytest.mark.parametrize("collate_fn", ["torch", "dataclass"])
def test_torch_default_collate_reuses_memory_too(collate_fn: str) -> None:
    """torch's own default_collate, passed as collate_fn or called by a user's collate that
    returns a dataclass, builds batches in reused memory, the same batches torch makes."""
    from torch.utils.data import default_collate as torch_collate

    fn = torch_collate if collate_fn == "torch" else pairs
    loader = aioloader.DataLoader(Images(64 * 8), batch_size=64, collate_fn=fn, quiet=True)
    try:
        seen = set()
        for b, batch in enumerate(loader):
            image = batch["image"] if collate_fn == "torch" else batch.image
            seen.add(image.data_ptr())
            if b == 0:
                assert torch.equal(image, torch_collate(
                    [Images(64)[i] for i in range(64)])["image"])
            assert image.untyped_storage().nbytes() == image.nbytes
        assert len(seen) <= 3, seen
        kept = list(loader)
        check(kept, 64)
    finally:
        loader.close()


def _drop_in_child(box: list[Any]) -> None:
    box.clear()


def test_a_batch_dropped_in_a_forked_child_does_not_hang_there() -> None:
    """The child inherits the finalizers, and maybe a lock that the fetch thread held at the
    fork: dropping the parent's batch there must not wait for it. The parent's pool is its
    own."""
    import multiprocessing

    memory = Recycler()
    box = [collate(memory, images(4))]
    held = memory.held()
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_drop_in_child, args=(box,))
    with memory._lock:  # as if the fetch thread held it at the fork: the child's copy is held
        child.start()
    child.join(60)
    assert child.exitcode == 0
    assert memory.held() == held
    box.clear()  # here it comes back
    assert memory.held() > held


async def test_two_loaders_at_once_and_one_dropped_unclosed() -> None:
    """Two in-process loaders share the process's buffers: interleaved, each batch stays its
    own; loaders built per call and dropped without a close leave the others intact."""
    a = aioloader.DataLoader(Images(64), batch_size=8, quiet=True)
    b = aioloader.DataLoader(Images(64), batch_size=8, shuffle=True, seed=3, quiet=True)
    kept_a: list[Any] = []
    kept_b: list[Any] = []
    try:
        other = aiter(b)
        async for x in a:
            kept_a.append(x)
            kept_b.append(await anext(other))
            dropped = aioloader.DataLoader(Images(16), batch_size=8, quiet=True)
            async for _ in dropped:
                break
            del dropped
            gc.collect()
        check(kept_a, 8)
        for y in kept_b:
            labels = y["label"].tolist()
            assert y["image"][:, 0, 0, 0].tolist() == [v % 251 for v in labels]
            assert bool((y["image"] == y["image"][:, :1, :1, :1]).all())
        assert sorted(v for y in kept_b for v in y["label"].tolist()) == list(range(64))
    finally:
        await a.aclose()
        await b.aclose()


def test_thread_workers_build_their_batches_in_reused_memory() -> None:
    """Thread workers hand batches over by reference: the same buffers serve them, and a
    batch kept while the workers build the next ones stays intact."""
    loader = aioloader.DataLoader(Images(8 * 12), batch_size=8, num_workers=2,
                                  worker_type="thread", quiet=True)
    try:
        kept = list(loader)
        check(kept, 8)
        assert len({b["image"].data_ptr() for b in kept}) == 12
        assert all(b["image"].untyped_storage().nbytes() == b["image"].nbytes for b in kept)
        del kept
        gc.collect()
        seen = {batch["image"].data_ptr() for batch in loader}
        assert len(seen) <= 2 * 4 + 2, seen  # what the workers may hold in flight, not 12
        check(list(loader), 8)
    finally:
        loader.close()
