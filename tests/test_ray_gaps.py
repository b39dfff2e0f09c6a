"""worker_type="ray" (issue 22): what tests/test_ray.py leaves unproven, on its cluster.

- backpressure: at most ``prefetch`` batches in flight per worker, and none built that no
  call asked for (the actors' own count of collates), for index batches and streams;
- an actor killed from outside mid-epoch, after the consumer took batches: healed, every
  sample once and in order; without restarts, a ``WorkerDied`` naming its node, host, pid;
- ``ray_options`` really reaches the actors (a node affinity, ``num_cpus``, a runtime env),
  and the samples themselves say which node read them;
- ``stats().workers[k].busy``;
- a loader nobody closed: the garbage collector kills its actors;
- without Ray (``import ray`` fails): ``import aioloader`` needs none, and
  ``worker_type="ray"`` says how to get it, at construction and at start.

Bugs this audit found, fixed (issue 22 audit), each a test below:

- a death before the actor's first reply (in ``worker_init_fn``) is healed within
  ``max_worker_restarts``, as worker processes heal it, and, without restarts, leaves no
  object of Ray's owned after close without a garbage collection;
- a Ray the loader started itself (no ``ray.init`` in the program) serves the next loader
  (it died with the thread that started it), and leaves no process behind the program;
- a map-style batch's ``CollateKeyError`` names the sample's dataset index, as with worker
  processes (the actor gave the collate no indices).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from ray_sources import Items, _once  # noqa: E402
from test_ray import (  # noqa: E402
    ON_NODES,
    assert_clean,
    cluster,  # noqa: F401 - the module's simulated 3-node cluster (a fixture)
    ids,
    pids_of,
    run,
)
from torch.utils.data import Dataset  # noqa: E402

import aioloader  # noqa: E402
from aioloader.testing import describe_pids, members  # noqa: E402

# Workers as Ray actors, kept between epochs (torch's default for a dataset is False, and
# these tests read the workers' stats after an epoch).
RAY: dict[str, Any] = {"worker_type": "ray", "persistent_workers": True}

pytestmark = [pytest.mark.leaks_ok, pytest.mark.deadline(90)]

TAG = "AIOLOADER_GAPS_TAG"


@pytest.fixture(scope="module")
def by_value(cluster: Cluster) -> Iterator[Cluster]:  # noqa: F811
    """This module's sources and functions travel to the actors by value, as ray_sources'."""
    me = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(me)
    try:
        yield cluster
    finally:
        cloudpickle.unregister_pickle_by_value(me)


# ---------------------------------------------------------------------- sources


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


class Big(Dataset[dict[str, Any]]):
    """256 kB batches of 4 (past Ray's 100 kB inline limit: they go through the store)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "x": torch.full((64 * 1024,), i % 256, dtype=torch.uint8)}


class BigLines(aioloader.Reader):
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield {"i": i, "x": torch.full((64 * 1024,), i % 256, dtype=torch.uint8)}


class CountingCollate:
    """Collates, and writes a line per batch built to ``log`` (from whichever actor)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        _append(self.log, "batch")
        return {"i": torch.tensor([x["i"] for x in items]),
                "x": torch.stack([x["x"] for x in items])}


def built(log: str) -> int:
    try:
        with open(log) as f:
            return len(f.read().split())
    except FileNotFoundError:
        return 0


class Where(Dataset[dict[str, Any]]):
    """Each sample says on which Ray node it was read, and the actor's ``TAG`` variable."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import ray

        return {"i": i, "node": ray.get_runtime_context().get_node_id(),
                "tag": os.environ.get(TAG, "")}


class KillOnce:
    """A worker_init_fn: worker 0 SIGKILLs itself, once across every process, before it
    has read anything (before a Ray actor has answered a single call)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __call__(self, worker_id: int) -> None:
        if worker_id == 0 and _once(self.flag):
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def collected() -> Iterator[None]:
    """For the tests of a death before the first reply: what a regression there leaves in
    reference cycles (a dead actor's reply) is collected, so that the next test's checks
    start clean (the test itself checks before this collection)."""
    yield
    gc.collect()


# ---------------------------------------------------------------------- backpressure


def _in_flight(loader: aioloader.DataLoader) -> list[list[Any]]:
    """The ObjectRefs of every actor's calls in flight (the supervisor's own)."""
    session = loader._run.owned.session  # (internals: the calls the object store holds for)
    assert session is not None
    return [list(w.link.calls) for w in session.producer.sup.workers]


def _settled(loader: aioloader.DataLoader) -> int:
    """Wait until every call in flight has its batch built (in the store); their count.
    The caller's loop is blocked meanwhile, so no call is added."""
    calls = _in_flight(loader)
    flat = [c for per in calls for c in per]
    ready, _ = ray.wait(flat, num_returns=len(flat), timeout=60, fetch_local=False)
    assert len(ready) == len(flat), "calls in flight never completed"
    del ready, flat
    return sum(len(per) for per in calls)


@pytest.mark.parametrize("kind", ["map", "stream"])
async def test_backpressure_at_most_prefetch_batches_per_worker(by_value: Cluster,
                                                                tmp_path: Any,
                                                                kind: str) -> None:
    log = str(tmp_path / "built")
    prefetch, workers, taken = 2, 2, 3
    common: dict[str, Any] = dict(batch_size=4, num_workers=workers, prefetch=prefetch,
                                  collate_fn=CountingCollate(log), **RAY,
                                  ray_options=ON_NODES, quiet=True)
    if kind == "map":
        loader = aioloader.DataLoader(Big(400), **common)
    else:
        loader = aioloader.DataLoader(BigLines(400), max_instances_in_memory=8, **common)
    it = aiter(loader)
    pids: list[int] = []
    try:
        for _ in range(taken):
            await anext(it)  # (each batch dropped at once)
        pids = pids_of(loader)
        per_actor = [len(c) for c in _in_flight(loader)]
        assert all(n <= prefetch for n in per_actor), per_actor
        in_flight = _settled(loader)
        # Every batch an actor built was taken or is one of the calls in flight: the
        # consumer stopped, and nothing more is built however long it waits.
        assert built(log) == taken + in_flight <= taken + workers * prefetch
        owned = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
        # the calls' batches, and the spec put once for the actors: nothing else
        assert len(owned) <= in_flight + 1, owned
        before = built(log)
        await anext(it)  # one more taken: one more asked for, and built
        in_flight = _settled(loader)
        assert all(len(c) <= prefetch for c in _in_flight(loader))
        assert built(log) == before + 1 == taken + 1 + in_flight
    finally:
        await loader.aclose()
    del it
    assert_clean(pids)


# ---------------------------------------------------------------------- faults


class Numbers(Dataset[int]):
    """A map-style dataset of keys: its load_fn builds the samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class PeakLoads:
    """An async load_fn that counts the loads in flight in its actor (all on the actor's
    one load loop) and holds each until ``target`` are in flight at once; each sample
    carries the most seen so far. ``patience``: a loader that never gets there (one
    batch's keys at a time) is let go, and its samples say how far it got."""

    def __init__(self, target: int, patience: float) -> None:
        self.target, self.patience = target, patience
        self.now = self.peak = 0
        self.reached: asyncio.Event | None = None

    async def __call__(self, key: int) -> dict[str, Any]:
        if self.reached is None:
            self.reached = asyncio.Event()
        self.now += 1
        self.peak = max(self.peak, self.now)
        if self.now >= self.target:
            self.reached.set()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reached.wait(), self.patience)
            self.reached.set()  # (gave up: nobody is held again)
            return {"k": key, "peak": self.peak}
        finally:
            self.now -= 1


def test_map_style_loads_overlap_across_batches(by_value: Cluster) -> None:
    """Issue 34: a load stage on a Ray actor starts a batch's loads while the batches
    before it still load, as a process worker does; ``concurrency`` bounds them (the calls
    in flight, ``slots``, are enough batches for that many)."""
    batch, concurrency = 4, 12
    loader = aioloader.DataLoader(Numbers(48), batch_size=batch, num_workers=1,
                                  load_fn=PeakLoads(batch + 1, 20.0), concurrency=concurrency,
                                  **RAY, quiet=True)
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert [b["k"].tolist() for b in batches] == [list(range(i, i + batch))
                                                  for i in range(0, 48, batch)]
    peak = max(int(b["peak"].max()) for b in batches)
    print(f"at most {peak} loads in flight at once in the actor (one batch: {batch} keys; "
          f"concurrency={concurrency})")
    assert batch < peak <= concurrency, peak


def test_death_before_the_first_reply_heals_within_restarts(by_value: Cluster,
                                                            tmp_path: Any,
                                                            collected: None) -> None:
    common: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=8, num_workers=2,
                                  max_worker_restarts=1, quiet=True)
    processes = aioloader.DataLoader(
        Items(32), worker_init_fn=KillOnce(str(tmp_path / "p")), **common)
    expected, _ = run(processes)
    assert processes.stats().restarts == 1  # the reference: worker processes heal it
    loader = aioloader.DataLoader(Items(32), worker_init_fn=KillOnce(str(tmp_path / "r")),
                                  **RAY, ray_options=ON_NODES, **common)
    failure = None
    try:
        got, pids = run(loader)
    except aioloader.WorkerDied as exc:
        failure = f"not healed: {exc}"  # (raised below: not chained to Ray's error)
    assert failure is None, failure
    assert os.path.exists(tmp_path / "r")  # an actor did die
    assert ids(got) == ids(expected)  # every sample once, in order
    assert loader.stats().restarts == 1
    assert_clean(pids)


def test_death_before_the_first_reply_leaves_no_object_after_close(by_value: Cluster,
                                                                   tmp_path: Any,
                                                                   collected: None) -> None:
    loader = aioloader.DataLoader(Items(32), worker_init_fn=KillOnce(str(tmp_path / "k")),
                                  batch_size=4, num_workers=2, **RAY,
                                  ray_options=ON_NODES, quiet=True)
    message = ""
    pids: list[int] = []
    try:
        list(loader)
    except aioloader.WorkerDied as exc:
        message = str(exc)  # (the exception itself is dropped: nothing of the user's holds it)
    finally:
        pids = pids_of(loader)
        loader.close()
    assert message
    # named as a later death is, though it never said where it ran: Ray's actor table did
    assert "worker 0" in message and "node " in message and "pid " in message, message
    assert socket.gethostname() in message, message
    assert_clean(pids)


def test_actor_killed_from_outside_mid_epoch_heals_in_order(cluster: Cluster) -> None:  # noqa: F811
    """The kill comes after the consumer took batches (not at an index the actor reaches
    while it starts): the calls in flight of the dead actor are asked again, in order."""
    common: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=9, num_workers=2,
                                  quiet=True)
    expected, _ = run(aioloader.DataLoader(Items(80), **common))
    loader = aioloader.DataLoader(Items(80), **RAY, ray_options=ON_NODES,
                                  max_worker_restarts=1, **common)
    got: list[dict[str, Any]] = []
    pids: list[int] = []
    try:
        it = iter(loader)
        got += [next(it) for _ in range(5)]
        victim = loader.stats().workers[1]
        assert victim.pid is not None
        pids.append(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        got += list(it)
        after = loader.stats()
        pids += pids_of(loader)
    finally:
        loader.close()
    assert ids(got) == ids(expected)  # every sample once, in order
    assert sorted(i for b in ids(got) for i in b) == list(range(80))
    assert after.restarts == 1
    assert victim.pid not in [w.pid for w in after.workers]  # a new actor took over
    assert_clean(pids)


def test_worker_died_names_the_node_host_and_pid(cluster: Cluster) -> None:  # noqa: F811
    loader = aioloader.DataLoader(Items(80), batch_size=4, num_workers=2, **RAY,
                                  ray_options=ON_NODES, quiet=True)
    pids: list[int] = []
    try:
        it = iter(loader)
        for _ in range(3):
            next(it)
        pids = pids_of(loader)
        victim = loader.stats().workers[1]
        assert victim.pid is not None and victim.node is not None
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(aioloader.WorkerDied) as info:
            list(it)
    finally:
        loader.close()
    message = str(info.value)
    assert info.value.worker_id == 1
    assert "worker 1" in message and f"pid {victim.pid}" in message
    assert f"node {victim.node[:12]}" in message and socket.gethostname() in message
    assert_clean(pids)


def _collate_key_error(loader: aioloader.DataLoader) -> tuple[BaseException, list[int]]:
    """The error of iterating ``loader`` (closed after), and its workers' pids."""
    pids: list[int] = []
    try:
        with pytest.raises(aioloader.CollateKeyError) as info:
            for _ in loader:
                pids = pids_of(loader)
        return info.value, pids
    finally:
        loader.close()


def test_collate_key_error_names_the_index_as_with_processes(cluster: Cluster) -> None:  # noqa: F811
    """The sample at index 6 (place 2 of the second batch) lacks the key "x": the error
    names its index under Ray too (the actor passed no indices to the collate before)."""
    data = [{"x": i} if i != 6 else {"y": i} for i in range(12)]
    common: dict[str, Any] = dict(batch_size=4, num_workers=1, quiet=True)
    expected, _ = _collate_key_error(aioloader.DataLoader(data, **common))
    got, pids = _collate_key_error(aioloader.DataLoader(data, **RAY, **common))
    for err in (expected, got):
        assert isinstance(err, KeyError) and isinstance(err, aioloader.WorkerError)
        assert isinstance(err.__cause__, aioloader.CollateKeyError)
    assert "sample 2 of the batch (index 6) has no key 'x'" in str(expected.__cause__)
    assert str(got.__cause__) == str(expected.__cause__)
    assert (got.sample, got.position) == (expected.sample, expected.position) == (6, 2)
    assert_clean(pids)


# ---------------------------------------------------------------------- options, stats


def test_ray_options_reach_the_actors(by_value: Cluster) -> None:
    """A hard node affinity puts both actors on one node (which has one CPU: only
    ``num_cpus=0.5`` lets both run there), and a runtime env's variable is theirs."""
    target = sorted(by_value.loader_nodes)[0]  # type: ignore[attr-defined]
    options = {"num_cpus": 0.5, "runtime_env": {"env_vars": {TAG: "gaps"}},
               "scheduling_strategy": NodeAffinitySchedulingStrategy(target, soft=False)}
    loader = aioloader.DataLoader(Where(16), batch_size=4, num_workers=2, **RAY,
                                  ray_options=options, quiet=True)
    try:
        got = list(loader)
        workers = loader.stats().workers
    finally:
        loader.close()
    assert {w.node for w in workers} == {target}
    assert {n for b in got for n in b["node"]} == {target}
    assert {t for b in got for t in b["tag"]} == {"gaps"}
    assert_clean([w.pid for w in workers if w.pid is not None])


def test_samples_themselves_are_read_on_two_nodes(by_value: Cluster) -> None:
    """The node each sample was read on, as the sample itself reports it (Ray's runtime
    context in ``__getitem__``), not as the stats say."""
    loader = aioloader.DataLoader(Where(32), batch_size=4, num_workers=2, **RAY,
                                  ray_options=ON_NODES, quiet=True)
    got, pids = run(loader)
    read_on = {n for b in got for n in b["node"]}
    assert read_on == by_value.loader_nodes  # type: ignore[attr-defined]
    assert len(read_on) == 2
    assert sorted(i for b in got for i in b["i"].tolist()) == list(range(32))
    assert_clean(pids)


def test_stats_report_busy_node_and_rate(cluster: Cluster) -> None:  # noqa: F811
    """Actors that sleep 40 ms a batch for a consumer that takes at once: busy most of
    the time they live (and never more than all of it)."""
    loader = aioloader.DataLoader(Items(64, sleep=0.01), batch_size=4, num_workers=2,
                                  **RAY, ray_options=ON_NODES, quiet=True)
    try:
        list(loader)
        workers = loader.stats().workers
    finally:
        loader.close()
    assert {w.node for w in workers} == cluster.loader_nodes  # type: ignore[attr-defined]
    for w in workers:
        assert w.batches == 8 and 0 < w.batches_per_s < 1 / 0.04 * 1.05, w
        assert 0.3 < w.busy <= 1.0, w
    assert_clean([w.pid for w in workers if w.pid is not None])


# ---------------------------------------------------------------------- close


def test_a_loader_nobody_closed_is_closed_by_the_garbage_collector(
        cluster: Cluster) -> None:  # noqa: F811
    loader = aioloader.DataLoader(Items(400), batch_size=4, num_workers=2, **RAY,
                                  quiet=True)
    it = iter(loader)
    next(it)
    pids = pids_of(loader)
    assert len(pids) == 2
    del it, loader
    gc.collect()
    assert_clean(pids)


# ---------------------------------------------------------------------- a Ray the loader starts

STARTS_RAY = textwrap.dedent("""
    import asyncio
    import sys
    import aioloader

    def loader():
        return aioloader.DataLoader(list(range(16)), batch_size=4, num_workers=2,
                                    worker_type="ray", quiet=True)

    def epoch():
        with loader() as batches:
            return [b.tolist() for b in batches]

    async def aepoch():
        async with loader() as batches:
            return [b.tolist() async for b in batches]

    if sys.argv[1] == "async":  # each in an asyncio.run of its own
        epoch = lambda: asyncio.run(aepoch())  # noqa: E731
    print("first", epoch(), flush=True)
    if sys.argv[1] in ("twice", "async"):
        print("second", epoch(), flush=True)
""")


def _script(mode: str, wait: float) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run STARTS_RAY in a session of its own (no ``ray.init`` in it: the loader starts a
    local Ray); what of that session still runs ``wait`` s after it exited (pidfds: woken
    by each exit), killed then."""
    env = {**os.environ, "RAY_ADDRESS": "local"}  # its own Ray, not this module's cluster
    proc = subprocess.Popen([sys.executable, "-c", STARTS_RAY, mode], text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    left: list[int] = []
    described: list[str] = []
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
        deadline = time.monotonic() + wait
        for pid in members(session=proc.pid):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                if not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
                    left.append(pid)
            finally:
                os.close(fd)
        described = [describe_pids([pid]) for pid in left]
        for pid in left:  # (ours: its session)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), described


@pytest.mark.deadline(120)
@pytest.mark.parametrize("mode", ["twice", "async"])
def test_a_ray_the_loader_started_serves_the_next_loader(mode: str) -> None:
    """Sync: the second loader's Ray call ended the process; async: the second
    ``asyncio.run`` hung (issue 22 audit)."""
    done, _ = _script(mode, wait=1.0)
    assert "first [[0, 1, 2, 3]" in done.stdout, done.stderr
    assert done.returncode == 0 and "second [[0, 1, 2, 3]" in done.stdout, (
        f"exit {done.returncode}; stdout {done.stdout!r}")


@pytest.mark.deadline(120)
def test_a_ray_the_loader_started_leaves_no_process_after_exit() -> None:
    done, left = _script("once", wait=15.0)
    assert done.returncode == 0 and "first [[0, 1, 2, 3]" in done.stdout, done.stderr
    assert left == [], f"processes of the program outlived it: {left}"


# ---------------------------------------------------------------------- without Ray

WITHOUT_RAY = textwrap.dedent("""
    import sys
    import aioloader
    assert "ray" not in sys.modules, "import aioloader imported ray"
    sys.modules["ray"] = None  # from here on, `import ray` fails as if it were absent
    try:
        aioloader.DataLoader(list(range(8)), batch_size=4, num_workers=1, worker_type="ray")
    except ImportError as exc:
        print("construction:", exc)
    else:
        raise SystemExit("constructed without Ray")
""")

BROKEN_RAY = textwrap.dedent("""
    import sys
    import aioloader
    loader = aioloader.DataLoader(list(range(8)), batch_size=4, num_workers=1,
                                  worker_type="ray", quiet=True)
    sys.modules["ray"] = None  # found at construction, fails to import when it starts
    try:
        list(loader)
    except ImportError as exc:
        print("start:", exc)
    else:
        raise SystemExit("ran without Ray")
    finally:
        loader.close()
""")


@pytest.mark.parametrize("script", [WITHOUT_RAY, BROKEN_RAY], ids=["absent", "broken"])
def test_without_ray_the_error_says_how_to_get_it(script: str) -> None:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install -e '.[ray]'" in out.stdout, out.stdout

