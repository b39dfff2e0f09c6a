"""worker_type="ray" (issue 22) on a simulated three-node Ray cluster in this machine.

One cluster for the module: a head (this process's driver) and two nodes, each with one
``loader`` resource, so that two workers asking for one each land on two distinct nodes.
Every loader is closed and then checked: no RayWorker actor alive, every actor's process
gone, and nothing left that this process owns in the object store.

The global leak check is off here (``leaks_ok``): Ray's own processes (raylets, idle
workers) are children of this process by design; the checks above are the ones that say
something about the loader.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import ray_sources  # noqa: E402
import torch  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray_sources import Items, Keys, Lines, mixed_collate  # noqa: E402

import aioloader  # noqa: E402

# Workers as Ray actors, kept between epochs (torch's default for a dataset is False, and
# these tests read the workers' stats after an epoch).
RAY: dict[str, Any] = {"worker_type": "ray", "persistent_workers": True}

pytestmark = [pytest.mark.leaks_ok, pytest.mark.deadline(90)]

ON_NODES = {"resources": {"loader": 1}}  # one worker per non-head node


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cloudpickle.register_pickle_by_value(ray_sources)  # actors need not import tests/
    # A lost node is noticed within about a second (Ray's default health checks take 15 s
    # or more to declare it dead).
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": {
        "health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
        "health_check_timeout_ms": 300, "health_check_failure_threshold": 2}})
    nodes = [c.add_node(num_cpus=1, resources={"loader": 1}) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    c.loader_nodes = {n.node_id for n in nodes}  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        cloudpickle.unregister_pickle_by_value(ray_sources)


def ids(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [b["i"].tolist() for b in batches]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]], draws: bool = True) -> bool:
    """Equal batches: instances, their order and (``draws``) every worker's random draws
    (a replaced worker is seeded again, with processes too: its draws start over)."""
    return len(a) == len(b) and all(
        x["i"].tolist() == y["i"].tolist() and torch.equal(x["x"], y["x"])
        and (not draws or torch.equal(x["r"], y["r"])) for x, y in zip(a, b, strict=True))


def pids_of(loader: aioloader.DataLoader) -> list[int]:
    return [w.pid for w in loader.stats().workers if w.pid is not None]


def assert_clean(pids: list[int]) -> None:
    """After a close: no RayWorker actor alive, its processes gone, no object owned here."""
    alive = [a for a in ray._private.state.actors().values()
             if a["ActorClassName"] == "RayWorker" and a["State"] != "DEAD"]
    assert alive == []
    for pid in pids:  # woken by the exit itself (a pidfd), not by polling
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], 15.0)
            assert ready, f"actor process {pid} still runs after close"
        finally:
            os.close(fd)
    owned = _owned()
    held = {ref: counts for ref, counts in owned.items() if counts["local"]}
    assert held == {}, f"objects this process still holds after close: {held}"
    # What may be left is only an argument of a task Ray has not concluded: an actor that
    # died while it was created keeps the spec 'submitted' until Ray's creation call returns,
    # a reply on another channel than the death notice that failed the close's probes (once
    # on the clean-clone CI at 63f5ad1). Ray gives no event for that release: wait for it.
    deadline = time.monotonic() + 30.0
    while owned and time.monotonic() < deadline:
        time.sleep(0.05)
        owned = _owned()
    assert owned == {}, f"objects left in the store: {owned}"


def _owned() -> dict[Any, dict[str, int]]:
    """Every object this process owns or borrows, with Ray's reference counts."""
    counts: dict[Any, dict[str, int]] = (
        ray._private.worker.global_worker.core_worker.get_all_reference_counts())
    return counts


def as_processes(options: dict[str, Any]) -> dict[str, Any]:
    """The same loader with worker processes: the reference a Ray loader must match."""
    return {k: v for k, v in options.items() if k not in ("worker_type", "ray_options")}


def run(loader: aioloader.DataLoader) -> tuple[list[dict[str, Any]], list[int]]:
    try:
        got = list(loader)
        return got, pids_of(loader)
    finally:
        loader.close()


def test_map_batches_identical_to_process_workers_on_two_nodes(cluster: Cluster) -> None:
    common: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=3, num_workers=2,
                                  quiet=True)
    expected, _ = run(aioloader.DataLoader(Items(40), **common))
    loader = aioloader.DataLoader(Items(40), **RAY, ray_options=ON_NODES,
                                  **common)
    try:
        got = list(loader)
        workers = loader.stats().workers
    finally:
        loader.close()
    assert same(got, expected)
    nodes = {w.node for w in workers}
    assert nodes == cluster.loader_nodes  # type: ignore[attr-defined]  # two distinct nodes
    by_worker = {w.worker: w.node for w in workers}
    read_on = {by_worker[int(w)] for b in got for w in b["w"]}
    assert len(read_on) == 2  # the samples themselves were read on both nodes
    assert all(w.batches == 5 and w.batches_per_s > 0 for w in workers)
    assert_clean([w.pid for w in workers if w.pid is not None])


def test_stream_identical_to_process_workers(cluster: Cluster) -> None:
    common: dict[str, Any] = dict(batch_size=3, shuffle=True, seed=5, num_workers=2,
                                  max_instances_in_memory=6, quiet=True)
    expected, _ = run(aioloader.DataLoader(Lines(30), **common))
    got, pids = run(aioloader.DataLoader(Lines(30), **RAY, ray_options=ON_NODES,
                                         **common))
    assert same(got, expected)
    assert_clean(pids)


@pytest.mark.parametrize("kind", ["cached", "loads"])
def test_cached_reader_and_load_stage_identical_to_process_workers(cluster: Cluster,
                                                                   kind: str) -> None:
    """A cached reader's pass of instances (the "instances" plan), and a stream of keys
    through the load stage."""
    if kind == "cached":
        common: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=6, num_workers=2)
        source: Any = Lines(24)
    else:
        common = dict(batch_size=4, seed=6, num_workers=2, max_instances_in_memory=8,
                      concurrency=4)
        source = Keys(24)
    expected, _ = run(aioloader.DataLoader(source, quiet=True, **common))
    got, pids = run(aioloader.DataLoader(source, **RAY, quiet=True, **common))
    assert same(got, expected)
    assert_clean(pids)


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_actor_killed_mid_epoch_heals_exactly_once_in_order(cluster: Cluster, tmp_path: Any,
                                                            kind: str) -> None:
    flag = str(tmp_path / "killed")
    if kind == "map":
        common: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=1, num_workers=2)

        def source(kill: bool) -> Any:
            return Items(48, kill_at=17 if kill else None, flag=flag)
    else:
        common = dict(batch_size=4, seed=1, num_workers=2, max_instances_in_memory=8)

        def source(kill: bool) -> Any:
            return Lines(48, kill_at=21 if kill else None, flag=flag)

    # (the same batches as Ray workers: the tests above; processes start in no time)
    expected, _ = run(aioloader.DataLoader(source(False), quiet=True, **common))
    loader = aioloader.DataLoader(source(True), **RAY, ray_options=ON_NODES,
                                  max_worker_restarts=1, quiet=True, **common)
    got, pids = run(loader)
    assert os.path.exists(flag)  # an actor did die
    assert ids(got) == ids(expected)  # every sample exactly once, in order
    flat = sorted(i for b in ids(got) for i in b)
    assert flat == list(range(48))
    assert loader.stats().restarts == 1
    assert_clean(pids)


def test_dead_actor_without_restarts_is_worker_died_naming_it(cluster: Cluster,
                                                              tmp_path: Any) -> None:
    loader = aioloader.DataLoader(Items(32, kill_at=9, flag=str(tmp_path / "k")),
                                  batch_size=4, num_workers=2, **RAY,
                                  ray_options=ON_NODES, quiet=True)
    pids: list[int] = []
    with pytest.raises(aioloader.WorkerDied) as info:
        try:
            list(loader)
        finally:
            pids = pids_of(loader)
            loader.close()
    message = str(info.value)
    assert "worker 0" in message and "Ray actor" in message and "node" in message
    assert info.value.worker_id == 0  # batch 2 (indices 8..11) is worker 0's
    assert_clean(pids)


def test_sync_adapter_moves_ray_batches_to_the_device(cluster: Cluster) -> None:
    loader = aioloader.DataLoader(Items(8), batch_size=4, num_workers=1, **RAY,
                                  quiet=True)
    try:
        got = list(loader.sync(device="meta"))  # how CPU-only tests see a device move
        pids = pids_of(loader)
    finally:
        loader.close()
    assert [b["x"].device.type for b in got] == ["meta", "meta"]
    assert_clean(pids)


def test_worker_exception_is_worker_error_of_its_type(cluster: Cluster) -> None:
    loader = aioloader.DataLoader(Items(16, fail_at=6), batch_size=4, num_workers=2,
                                  **RAY, quiet=True)
    with pytest.raises(KeyError) as info:
        try:
            list(loader)
        finally:
            loader.close()
    assert isinstance(info.value, aioloader.WorkerError)
    assert "no item 6" in str(info.value) and "Traceback from the worker" in str(info.value)


def test_exact_resume_and_recycling(cluster: Cluster) -> None:
    common: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=7, num_workers=2,
                                  **RAY, quiet=True)
    expected, _ = run(aioloader.DataLoader(Items(40), **as_processes(common)))
    first = aioloader.DataLoader(Items(40), max_batches_per_worker=2, **common)
    try:
        it = iter(first)
        head = [next(it) for _ in range(6)]
        state = first.state_dict()
        recycles = first.stats().recycles
    finally:
        first.close()
    assert recycles >= 2  # each worker retired after 2 batches: successors took over
    fresh = aioloader.DataLoader(Items(40), **common)
    fresh.load_state_dict(state)
    tail, pids = run(fresh)
    assert same(head + tail, expected, draws=False)
    assert_clean(pids)


@pytest.mark.filterwarnings("ignore::aioloader.ResumeWarning")  # Lines has no state_dict
def test_stream_resume_and_recycling(cluster: Cluster) -> None:
    common: dict[str, Any] = dict(batch_size=3, shuffle=True, seed=2, num_workers=2,
                                  max_instances_in_memory=6, **RAY, quiet=True)
    expected, _ = run(aioloader.DataLoader(Lines(36), **as_processes(common)))
    first = aioloader.DataLoader(Lines(36), max_batches_per_worker=2, **common)
    try:
        it = iter(first)
        head = [next(it) for _ in range(5)]
        state = first.state_dict()
        recycles = first.stats().recycles
    finally:
        first.close()
    assert recycles >= 1  # a stream's worker hands over at a block's start
    fresh = aioloader.DataLoader(Lines(36), **common)
    fresh.load_state_dict(state)
    tail, pids = run(fresh)
    assert same(head + tail, expected, draws=False)
    assert_clean(pids)


async def test_async_for_leaves_the_loop_free_and_close_from_another_task(
        cluster: Cluster) -> None:
    loader = aioloader.DataLoader(Items(400), batch_size=4, num_workers=2,
                                  **RAY, quiet=True)
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    tick = asyncio.create_task(ticker())
    got = 0
    pids: list[int] = []
    began = time.monotonic()
    with pytest.raises(aioloader.LoaderClosedError):
        async for _ in loader:
            got += 1
            if got == 1:
                # the wait for the first batch (actors starting) left the loop running
                assert ticks >= (time.monotonic() - began) / 0.01 / 4
                pids = pids_of(loader)
                asyncio.get_running_loop().call_soon(
                    lambda: asyncio.ensure_future(loader.aclose()))
    stop.set()
    await tick
    await loader.aclose()
    assert 1 <= got < 100
    assert_clean(pids)


def test_close_from_another_thread_ends_a_waiting_consumer(cluster: Cluster) -> None:
    loader = aioloader.DataLoader(Items(400, sleep=0.05), batch_size=4, num_workers=2,
                                  **RAY, quiet=True)
    first = threading.Event()
    ended: list[BaseException] = []

    def consume() -> None:
        try:
            for _ in loader:
                first.set()
        except BaseException as exc:  # noqa: BLE001 - what the consumer saw, checked below
            ended.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert first.wait(60)
    pids = pids_of(loader)
    loader.close()  # from this thread, while the consumer waits for a 0.2 s batch
    consumer.join(10)
    assert not consumer.is_alive()
    assert [type(e) for e in ended] == [aioloader.LoaderClosedError]
    assert_clean(pids)


def assert_same_value(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad)
        assert torch.equal(a.detach(), b.detach())
    elif isinstance(a, dict | collections.UserDict):
        assert list(a) == list(b)
        for k in a:
            assert_same_value(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_value(x, y)
    elif dataclasses.is_dataclass(a):
        assert_same_value(dataclasses.asdict(a), dataclasses.asdict(b))  # type: ignore[arg-type]
    else:
        assert a == b


@pytest.mark.parametrize("zero_copy", [True, False])
def test_every_kind_of_value_comes_back_as_built(cluster: Cluster, zero_copy: bool) -> None:
    common: dict[str, Any] = dict(batch_size=4, num_workers=1, collate_fn=mixed_collate,
                                  zero_copy=zero_copy, quiet=True)
    expected, _ = run(aioloader.DataLoader(Items(8), **common))
    got, pids = run(aioloader.DataLoader(Items(8), **RAY, **common))
    assert_same_value(got, expected)
    got[0]["t"].add_(1)  # the consumer's own: writable, and valid after the close
    assert torch.equal(got[0]["t"], expected[0]["t"] + 1)
    assert_clean(pids)


def test_a_source_ray_cannot_send_fails_before_any_actor(cluster: Cluster) -> None:
    source = Items(8)
    source.lock = threading.Lock()  # type: ignore[attr-defined]
    loader = aioloader.DataLoader(source, batch_size=4, num_workers=1, **RAY,
                                  quiet=True)
    with pytest.raises(aioloader.SourcePicklingError, match="cannot be sent to Ray actors"):
        try:
            list(loader)
        finally:
            loader.close()
    assert_clean([])


class _Said(logging.Handler):
    """The aioloader warnings logged; :meth:`wait_for` one that says something."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.messages.append(record.getMessage())
            self.changed.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        with self.changed:
            assert self.changed.wait_for(
                lambda: any(text in m for m in self.messages), timeout), self.messages
            return next(m for m in self.messages if text in m)


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Said]:
    """Warnings of aioloader, with an actor's patience to start cut to a blink."""
    monkeypatch.setattr("aioloader.workers._ray.PLACEMENT_PATIENCE", 0.05)
    handler, log = _Said(), logging.getLogger("aioloader")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def test_an_actor_that_is_slow_to_start_is_named_with_its_node(cluster: Cluster,
                                                               tmp_path: Any,
                                                               said: _Said) -> None:
    """Placed, but its process still starting: the warning says where, not that Ray has
    no room (it said so while workers imported torch on a busy machine)."""
    fifo = str(tmp_path / "start")
    os.mkfifo(fifo)
    loader = aioloader.DataLoader(Items(8), batch_size=4, num_workers=1, **RAY,
                                  worker_init_fn=functools.partial(ray_sources.wait_for_a_writer,
                                                                   fifo), quiet=True)
    pids: list[int] = []
    try:
        it = iter(loader)
        first = concurrent.futures.ThreadPoolExecutor(1)
        try:
            got = first.submit(next, it)
            # (said again, after twice as long each time: once Ray has placed it, this)
            message = said.wait_for("Ray placed it on node")
            with open(fifo, "w"):  # lets it start
                pass
            batches = [got.result(60), *it]
        finally:
            first.shutdown()
        pids = pids_of(loader)
        node = loader.stats().workers[0].node
    finally:
        loader.close()
    assert [b["i"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert f"Ray placed it on node {node}" in message, message
    assert "still starting" in message and f"pid {pids[0]}" in message, message
    assert_clean(pids)


def test_an_actor_no_node_can_take_is_named_with_what_it_asks(cluster: Cluster,
                                                              said: _Said) -> None:
    loader = aioloader.DataLoader(Items(8), batch_size=4, num_workers=1, **RAY,
                                  ray_options={"resources": {"nowhere": 1}}, quiet=True)

    async def until_warned() -> str:
        async with loader:
            first = asyncio.ensure_future(anext(aiter(loader)))
            try:
                return await asyncio.to_thread(said.wait_for, "Ray has no node")
            finally:
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)

    message = asyncio.run(until_warned())
    assert "is not running after" in message and "'nowhere': 1" in message, message
    assert_clean([])


def test_lost_node_heals_on_another_node(cluster: Cluster) -> None:
    """Last in the module: it adds a spare node and takes a worker's node away."""
    common: dict[str, Any] = dict(batch_size=4, seed=4, num_workers=2, shuffle=True,
                                  max_instances_in_memory=8, **RAY,
                                  ray_options=ON_NODES, quiet=True)
    expected, _ = run(aioloader.DataLoader(Lines(160), **as_processes(common)))
    spare = cluster.add_node(num_cpus=1, resources={"loader": 1})
    cluster.wait_for_nodes()
    loader = aioloader.DataLoader(Lines(160), max_worker_restarts=1, **common)
    got: list[dict[str, Any]] = []
    pids: list[int] = []
    try:
        it = iter(loader)
        got += [next(it) for _ in range(3)]
        pids = pids_of(loader)
        before = {w.node for w in loader.stats().workers}
        victim = loader.stats().workers[1]
        lost = victim.node
        node = next(n for n in cluster.list_all_nodes() if n.node_id == lost)
        # A machine gone: its raylet, and with it every process of it (an actor's process
        # left alone goes on serving calls made to it directly until it notices).
        cluster.remove_node(node, allow_graceful=False)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        got += list(it)
        nodes = {w.node for w in loader.stats().workers}
        restarts = loader.stats().restarts
        pids += pids_of(loader)
    finally:
        loader.close()
    assert ids(got) == ids(expected)  # every sample once, in order
    assert restarts == 1  # (at most 8 batches were in flight when the node went)
    free = (cluster.loader_nodes | {spare.node_id}) - before  # type: ignore[attr-defined]
    assert nodes == (before - {lost}) | free  # the new actor runs where there was room
    assert_clean(pids)
