"""How people really write training scripts (issue 9): each test is such a script.

Loaders are closed only where a user would close them; the others are dropped and left to
the garbage collector, and the autouse leak check (tests/conftest.py) then finds no child
process, fd or /dev/shm entry left. The sources are in scripts_issue9/issue9_sources.py,
at module level, so that spawned workers and ranks can import them.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, default_collate

import aioloader
from aioloader.testing import LeakSnapshot, check_leaks

sys.path.insert(0, str(Path(__file__).parent / "scripts_issue9"))
import dist_helpers
import issue9_dist
import issue9_sources as S

FORK = multiprocessing.get_context("fork")
PROMPT = 10.0  # seconds: "promptly", with room for a loaded 2-core machine


def indices(batches: list[Any]) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


async def acollect(loader: Any) -> list[Any]:
    return [b async for b in loader]


# ------------------------------------------------------------------ train / val, per epoch

@pytest.mark.deadline(120)
@pytest.mark.parametrize("face", ["sync", "async"])
def test_train_and_val_loaders_interleaved_over_epochs_never_closed(face):
    train = aioloader.DataLoader(S.Records(64), batch_size=8, shuffle=True, num_workers=2,
                                 quiet=True)
    val = aioloader.DataLoader(S.Records(24), batch_size=8, num_workers=2, quiet=True)

    def epoch(loader: aioloader.DataLoader) -> list[Any]:
        return list(loader) if face == "sync" else asyncio.run(acollect(loader))

    for _ in range(3):
        assert sorted(indices(epoch(train))) == list(range(64))
        assert indices(epoch(val)) == list(range(24))


# ------------------------------------------------------- a loader per evaluation call

def evaluate(dataset: Any, start_method: str) -> int:
    loader = aioloader.DataLoader(dataset, batch_size=32, num_workers=2,
                                  start_method=start_method, quiet=True)
    return sum(int(batch.sum()) for batch in loader)


@pytest.mark.deadline(240)
@pytest.mark.parametrize(("start_method", "calls"), [("fork", 10), ("spawn", 3)])
def test_a_loader_built_per_evaluation_call_never_closed(start_method, calls):
    # spawn: 3 calls, not 10 (each spawned worker imports torch: ~4 s here); the garbage
    # collector's hazard (a finalizer inherited by a forked child) is fork's anyway
    dataset = S.Ints(96)
    assert [evaluate(dataset, start_method) for _ in range(calls)] == [sum(range(96))] * calls


# ------------------------------------------------------------- two loaders, one event loop

@pytest.mark.deadline(90)
async def test_two_loaders_iterated_concurrently_in_one_event_loop():
    a = aioloader.DataLoader(S.Slow(24, 0.01), batch_size=4, num_workers=2, quiet=True)
    b = aioloader.DataLoader(S.Records(40), batch_size=4, shuffle=True, num_workers=2,
                             quiet=True)
    got_a, got_b = await asyncio.wait_for(asyncio.gather(acollect(a), acollect(b)), 60)
    assert indices(got_a) == list(range(24))
    assert sorted(indices(got_b)) == list(range(40))
    # and again, now that both have workers waiting for their next epoch
    again = await asyncio.wait_for(asyncio.gather(acollect(a), acollect(b)), 60)
    assert [len(x) for x in again] == [6, 10]


# --------------------------------------------------------------- consumed from a thread

@pytest.mark.deadline(90)
@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_consumed_from_a_worker_thread(face, num_workers):
    loader = aioloader.DataLoader(S.Records(40), batch_size=4, num_workers=num_workers,
                                  quiet=True)
    results: list[Any] = []

    def work() -> None:
        try:
            for _ in range(2):
                batches = list(loader) if face == "sync" else asyncio.run(acollect(loader))
                results.append(indices(batches))
        except BaseException as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the thread still iterates after 60s"
    assert results == [list(range(40))] * 2


# --------------------------------------------------------------- next(iter(loader)) x 20

@pytest.mark.deadline(60)
@pytest.mark.parametrize("lazy", [None, 16])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dropped_loader_is_collected_whatever_its_mode(num_workers, lazy):
    """A lazy in-process loader once held itself through its producer (a bound method of
    the loader given as the seed function), so it was never collected and kept its loop's
    fds: the leak check after this test fails on that."""
    loader = aioloader.DataLoader(dist_helpers.Numbers(40), batch_size=8,
                                  num_workers=num_workers, max_instances_in_memory=lazy,
                                  quiet=True)
    assert sum(len(b["index"]) for b in loader) == 40
    ref = weakref.ref(loader)
    del loader
    gc.collect()
    assert ref() is None


@pytest.mark.deadline(120)
def test_next_iter_loader_in_a_loop():
    loader = aioloader.DataLoader(S.Records(64), batch_size=8, num_workers=2, quiet=True)
    for _ in range(20):
        batch = next(iter(loader))  # the iterator is dropped at once, its epoch unfinished
        assert batch["index"].tolist() == list(range(8))


@pytest.mark.deadline(120)
async def test_anext_aiter_loader_in_a_loop():
    loader = aioloader.DataLoader(S.Records(64), batch_size=8, num_workers=2, quiet=True)
    for _ in range(20):
        batch = await asyncio.wait_for(anext(aiter(loader)), 30)
        assert batch["index"].tolist() == list(range(8))


# ---------------------------------------------------------------------- and asyncio.run

@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_created_inside_asyncio_run(num_workers):
    async def main() -> list[int]:
        loader = aioloader.DataLoader(S.Records(20), batch_size=4, num_workers=num_workers,
                                      quiet=True)
        return indices([b async for b in loader])

    assert asyncio.run(main()) == list(range(20))
    assert asyncio.run(main()) == list(range(20))


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_created_before_asyncio_run_and_used_inside_it(num_workers):
    loader = aioloader.DataLoader(S.Records(20), batch_size=4, num_workers=num_workers,
                                  quiet=True)
    assert indices(list(loader)) == list(range(20))  # the sync face first, in plain code

    async def main() -> list[int]:
        return indices([b async for b in loader])

    assert asyncio.run(main()) == list(range(20))
    assert asyncio.run(main()) == list(range(20))  # a second loop, the same loader
    assert indices(list(loader)) == list(range(20))  # and the sync face again


# ------------------------------------------- dropped, never closed, while others fork

@pytest.mark.deadline(180)
@pytest.mark.parametrize("drop", ["del-and-collect", "in-a-cycle"])
def test_loaders_dropped_unclosed_while_others_fork_leave_nothing(drop):
    baseline = LeakSnapshot.take()
    kept: list[tuple[int, torch.Tensor]] = []
    for k in range(6):
        # batches of 8 x 3 x 128 x 128 bytes (384 KiB): large enough to be leased
        loader = aioloader.DataLoader(S.Images(48, size=128), batch_size=8, num_workers=2,
                                      quiet=True)
        for n, batch in enumerate(loader):
            if n == 0:
                kept.append((int(batch["label"][0]), batch["image"]))  # outlives its loader
            if k % 2 and n == 2:
                break  # half the loaders are dropped mid-epoch
        if drop == "in-a-cycle":
            holder: dict[str, Any] = {"loader": loader}
            holder["self"] = holder  # collected whenever the collector runs, in any process
            del holder
        del loader, batch
        if drop == "del-and-collect":
            gc.collect()
    _check_kept(kept)
    del kept
    check_leaks(baseline, deadline=PROMPT)


def _check_kept(kept: list[tuple[int, torch.Tensor]]) -> None:
    for label, image in kept:
        assert image.shape == (8, 3, 128, 128)
        assert bool((image[0] == label % 251).all()), "a batch changed after its loader went"


# ------------------------------------------------------- a close from another task or thread

@pytest.mark.deadline(90)
async def test_service_shutdown_from_another_task():
    loader = aioloader.DataLoader(S.Slow(40, 0.2), batch_size=1, num_workers=2, quiet=True)
    first = asyncio.Event()

    async def serve() -> int:
        served = 0
        async for _ in loader:
            served += 1
            first.set()
        return served

    async def shutdown() -> None:
        await first.wait()
        await loader.aclose()

    server = asyncio.create_task(serve())
    await asyncio.wait_for(shutdown(), 60)
    done, _ = await asyncio.wait({server}, timeout=PROMPT)
    assert done, f"the server still waits for a batch {PROMPT:.0f}s after aclose()"
    with pytest.raises(aioloader.LoaderClosedError):
        server.result()
    # the same loader serves again after the shutdown
    again = []
    async for batch in loader:
        again.append(batch)
        if len(again) == 2:
            break
    assert indices(again) == [0, 1]
    await loader.aclose()


@pytest.mark.deadline(90)
async def test_a_watchdog_thread_closes_the_loader_of_an_async_consumer():
    loader = aioloader.DataLoader(S.Slow(40, 0.2), batch_size=1, num_workers=2, quiet=True)
    first, closed = threading.Event(), threading.Event()
    problems: list[BaseException] = []

    def watchdog() -> None:
        if first.wait(60):
            try:
                loader.close()
            except BaseException as exc:  # noqa: BLE001 - reported below
                problems.append(exc)
        closed.set()

    async def consume() -> None:
        async for _ in loader:
            first.set()

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    task = asyncio.create_task(consume())
    try:
        assert await asyncio.to_thread(closed.wait, 60)
        done, _ = await asyncio.wait({task}, timeout=PROMPT)
        assert done, f"the consumer still waits {PROMPT:.0f}s after close() from a thread"
        with pytest.raises(aioloader.LoaderClosedError):
            task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=PROMPT)
        await asyncio.to_thread(thread.join, 30)
    assert not problems, problems


# --------------------------------------------------------------------------- odd values

def _check_surrogates(batch: Any, first: int, dataset: Any) -> None:
    expected = default_collate([dataset[i] for i in range(first, first + 4)])
    assert type(batch) is dict and batch["path"] == expected["path"]
    assert torch.equal(batch["x"], expected["x"])


def _check_encoding(batch: Any, first: int, dataset: Any) -> None:
    expected = S.collate_encoding([dataset[i] for i in range(first, first + 4)])
    assert type(batch) is S.Encoding, type(batch)
    assert batch.keys() == expected.keys()
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert torch.equal(batch["attention_mask"], expected["attention_mask"])
    assert batch["paths"] == expected["paths"]


def _check_dataclass(batch: Any, first: int, dataset: Any) -> None:
    expected = S.collate_dataclass([dataset[i] for i in range(first, first + 4)])
    assert type(batch) is S.Batch, type(batch)
    assert torch.equal(batch.ids, expected.ids) and torch.equal(batch.lengths, expected.lengths)
    assert batch.names == expected.names
    assert batch.weight.shape == () and float(batch.weight) == 0.5


def _check_scalars(batch: Any, first: int, dataset: Any) -> None:
    expected = S.collate_scalars([dataset[i] for i in range(first, first + 4)])
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        assert batch[key].shape == value.shape and batch[key].dtype == value.dtype, key
        assert torch.equal(batch[key], value), key


ODD = {
    "surrogate-strings": (None, _check_surrogates),
    "userdict-subclass": (S.collate_encoding, _check_encoding),
    "dataclass": (S.collate_dataclass, _check_dataclass),
    "0-d-tensors": (S.collate_scalars, _check_scalars),
}


@pytest.mark.deadline(90)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", list(ODD))
def test_odd_values_come_back_as_they_were(case, num_workers):
    collate_fn, check = ODD[case]
    dataset = S.Named(12)
    loader = aioloader.DataLoader(dataset, batch_size=4, num_workers=num_workers,
                                  collate_fn=collate_fn, quiet=True)
    batches = list(loader)
    assert len(batches) == 3
    for k, batch in enumerate(batches):
        check(batch, 4 * k, dataset)


@pytest.mark.deadline(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_64_mb_tensor(num_workers):
    loader = aioloader.DataLoader(S.Huge(3), batch_size=1, num_workers=num_workers,
                                  quiet=True)
    for i, batch in enumerate(loader):
        assert batch.shape == (1, 16 << 20) and batch.dtype == torch.float32
        assert bool((batch == float(i)).all()), f"batch {i}"
    assert i == 2


# ------------------------------------------------- a dataset that allocates per sample

@pytest.mark.deadline(90)
@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_that_allocates_a_new_tensor_per_sample(num_workers, face):
    loader = aioloader.DataLoader(S.Images(96, size=64), batch_size=8, num_workers=num_workers,
                                  quiet=True)
    batches = list(loader) if face == "sync" else asyncio.run(acollect(loader))
    assert len(batches) == 12
    for k, batch in enumerate(batches):
        labels = list(range(8 * k, 8 * k + 8))
        assert batch["label"].tolist() == labels
        assert batch["image"].shape == (8, 3, 64, 64) and batch["image"].dtype == torch.uint8
        for j, label in enumerate(labels):
            assert bool((batch["image"][j] == label % 251).all())


# ------------------------------------------------------------- DistributedSampler scripts

@pytest.mark.deadline(90)
def test_a_resumed_run_gets_the_epochs_its_sampler_was_set_to():
    """Resuming at epoch 5, the script calls sampler.set_epoch(5), 6, 7 (torch's recipe): the
    batches are what the user's sampler yields for those epochs, as with torch's loader."""
    ds = dist_helpers.NumbersDataset(64)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=5)
    loader = aioloader.DataLoader(ds, batch_sampler=BatchSampler(sampler, 8, False),
                                  num_workers=2, quiet=True)
    for epoch in range(5, 8):
        sampler.set_epoch(epoch)
        expected = [list(b) for b in BatchSampler(sampler, 8, False)]
        assert [b["index"].tolist() for b in loader] == expected, f"epoch {epoch}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    cases = ["sampler_set_epoch", "len_rank0_only"]  # len last: it may leave a rank hung
    return issue9_dist.run_ranks(tmp_path_factory.mktemp("ranks"), cases, deadline=120)


@pytest.mark.deadline(180)
def test_len_of_a_distributed_sampler_loader_on_one_rank_does_not_hang(two_ranks):
    res = two_ranks[0]["len_rank0_only"]
    assert not res.get("hang"), "len(loader) on rank 0 alone waited for rank 1"
    assert res == {"len": 15}, res  # 120 indices of this rank, batches of 8


@pytest.mark.deadline(180)
def test_distributed_sampler_set_epoch_every_epoch_never_closed(two_ranks):
    epochs = []
    for r in range(2):
        res = two_ranks[r]["sampler_set_epoch"]
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["len"] == 15
        for e, epoch in enumerate(res["epochs"]):
            assert epoch["indices"] == epoch["expected"], f"rank {r}, epoch {e}"
        epochs.append(res["epochs"])
    for e in range(3):
        seen = epochs[0][e]["indices"] + epochs[1][e]["indices"]
        assert sorted(seen) == list(range(issue9_dist.N)), f"epoch {e}"
    assert epochs[0][0]["indices"] != epochs[0][1]["indices"], "set_epoch reshuffles"


@pytest.mark.parametrize("source", ["list(range(10))", "Ten()"])  # Ten: a cache fills first
def test_a_closed_quiet_loader_leaves_no_thread_in_the_users_process(source):
    # A disabled tqdm still starts tqdm's monitor thread, which lives as long as the process:
    # quiet=True must not make one. Every other thread ends by itself once the loader is
    # closed (close() does not wait for them: a sampler stuck in planning must not hang it).
    script = (
        "import threading, aioloader\n"
        "class Ten(aioloader.Reader):\n"
        "    def read(self, data_path):\n"
        "        yield from range(10)\n"
        f"loader = aioloader.DataLoader({source}, batch_size=4, quiet=True)\n"
        "for _ in range(2):\n"
        "    assert [len(b) for b in loader] == [4, 4, 2]\n"
        "loader.close()\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
        "for t in threading.enumerate():\n"
        "    if t is not threading.main_thread():\n"
        "        t.join(timeout=60)\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert "tqdm" not in out[0]
    assert out[1] == "['MainThread']"


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("face", ["for", "sync()", "async for", "for, inside a running loop"])
def test_the_last_batch_of_an_epoch_is_freed_when_the_user_drops_it(num_workers, face):
    # Without the cyclic GC: a batch kept alive by a reference cycle (an exception's
    # traceback holding the adapter's frames) would hold its memory (host or GPU) until
    # some later collection, and every epoch's last batch would.
    loader = aioloader.DataLoader(torch.arange(12.0), batch_size=4, num_workers=num_workers,
                                  quiet=True)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            if face == "async for":
                async def last() -> torch.Tensor:
                    kept = None
                    async for batch in loader:
                        kept = batch
                    return kept

                kept = asyncio.run(last())
            elif face == "for, inside a running loop":  # Jupyter: the adapter's thread loop
                async def last_sync() -> torch.Tensor:
                    kept = None
                    for batch in loader:
                        kept = batch
                    return kept

                kept = asyncio.run(last_sync())
            else:
                kept = None
                for batch in (loader if face == "for" else loader.sync()):
                    kept = batch
                del batch
            ref = weakref.ref(kept)
            del kept
            assert ref() is None, "the epoch's last batch outlived the user's last reference"
    finally:
        gc.enable()
        loader.close()


FORKED_CHILD = """
import asyncio, multiprocessing, sys
import aioloader

def epoch(face):
    loader = aioloader.DataLoader(list(range(10)), batch_size=4, num_workers=2, quiet=True)
    with loader:
        if face == "sync":
            return [b.tolist() for b in loader]
        async def consume():
            return [b.tolist() async for b in loader]
        return asyncio.run(consume())

def child(face, out):
    out.put(epoch(face))

if __name__ == "__main__":
    parents = aioloader.DataLoader(list(range(10)), batch_size=4, num_workers=2, quiet=True)
    assert len(list(parents)) == 3
    if sys.argv[1] == "closed":
        parents.close()
    ctx = multiprocessing.get_context("fork")
    for face in ("sync", "async"):
        out = ctx.Queue()
        p = ctx.Process(target=child, args=(face, out))
        p.start()
        print(face, out.get(timeout=60), flush=True)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    parents.close()
"""


@pytest.mark.parametrize("parents", ["closed", "alive"])
def test_a_forked_child_makes_its_own_loader_after_its_parent_used_one(parents, tmp_path):
    """A training script that forks (multiprocessing's default on Linux) after it used a
    loader: the child's own loader starts its workers. The starter thread was inherited as
    an executor without its thread: the child waited forever for its first batch."""
    import subprocess

    script = tmp_path / "forks.py"
    script.write_text(FORKED_CHILD)
    out = subprocess.run([sys.executable, str(script), parents], capture_output=True,
                         text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    want = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert out.stdout.splitlines() == [f"sync {want}", f"async {want}"]
