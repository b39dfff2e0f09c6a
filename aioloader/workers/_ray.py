"""Workers on a Ray cluster (``worker_type="ray"``): the supervisor's interface over actors.

:class:`RaySupervisor` answers what the producers (aioloader/workers/_producers.py) ask of a
supervisor: ``start``, ``request``, ``receive``, ``restart``, ``stats``, ``describe``,
``close``. So ordering, resume positions and the restart logic are the producers' own,
unchanged; what differs is the transport::

    producer ── receive(w) ──> RaySupervisor ── await ObjectRef ──> actor w (RayWorker)
                request(w, seq, indices) ─── fetch.remote(seq, indices) ──┘  (index batches)
                at most ``slots`` calls in flight per actor ── next.remote() ┘  (streams)

Each actor (aioloader/workers/_ray_actor.py) runs the worker's pipeline where Ray placed it and
returns whole batches; a batch reaches this process through Ray's object store, its
tensors as views of the object's buffer (zero-copy on the actor's node; from another node
Ray first moves the object into this node's store), copied out with ``zero_copy=False``.
The calls in flight are the backpressure: an actor builds a batch only for a call, and a
stream's calls are topped up as batches are taken, so at most ``slots`` batches per worker
sit in the store untaken. Awaiting an ``ObjectRef`` never blocks the loop.

A Ray the loader had to start (no ``ray.init`` before it) stays up for the process, as a
forkserver does: shutting it down would end any other Ray work of the process. So it is
started on a thread that lives as long as the process (see :func:`_on_init_thread`).

Faults: a call of a dead actor (or one whose batch was lost with its node) raises Ray's
error, which becomes a :class:`~aioloader.WorkerDied` naming the worker, its actor, node
and pid; within ``max_worker_restarts`` it is :class:`~aioloader.workers._phases.WorkerLost`
instead, raised where that worker's next batch is due (the batches it delivered before
come first), and the producer's ``restart`` starts a new actor from the consumer's
position. Closing kills every actor and drops every reference, so nothing of the loader
stays in the object store.

Imports Ray only when a supervisor starts: ``import aioloader`` never needs it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from .._errors import (
    LoaderClosedError,
    SourcePicklingError,
    WorkerDied,
    WorkerError,
    worker_error_for,
)
from .._options import RAY_MISSING
from .._stats import ArenaStats, WorkerStats
from ..pipeline._loads import SkipLog, SkippedLoad
from ..plans._position import ShardPosition
from ._phases import RestartBudget, WorkerLost
from ._ray_actor import Hello, PassOver, Raised, RayWorker, Reply, Retire
from ._supervisor import Arrival, Ended, Received
from ._worker import WorkerSpec

log = logging.getLogger("aioloader")

PLACEMENT_PATIENCE = 30.0  # s an actor may take to start before a warning says why (again
# after twice that each time)
CLOSE_WAIT = 10.0  # seconds a close waits for Ray to confirm that its actors are dead
LOOKUP_WAIT = 5.0  # seconds a death's message waits for Ray to say where the actor ran


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(RAY_MISSING) from exc
    return ray


@dataclass(eq=False)
class _Actor:
    """One worker's actor, as the parent sees it: its calls in flight, in order."""

    id: int
    handle: Any
    hello: Any  # the ObjectRef of its Hello, until it is known
    calls: collections.deque[Any] = field(default_factory=collections.deque)  # ObjectRefs
    numbered: int = 0  # calls made: the actor serves them in this order
    where: Hello | None = None
    born: float = field(default_factory=time.monotonic)
    last: float = 0.0
    batches: int = 0
    busy: float = 0.0
    successor: _Actor | None = None  # recycling: new calls go to it, old ones drain first
    lost: WorkerDied | None = None  # died, within the budget: restart() replaces it
    heard: float = 0.0  # its latest reply (0: none yet; ``born`` counts then)
    silenced: float | None = None  # killed as hung: the seconds it had been silent

    def number(self) -> int:
        self.numbered += 1
        return self.numbered - 1

    def actor(self) -> str:
        """'Ray actor 1a2b3c on node 4d5e6f (host)': where this worker runs."""
        actor = self.handle._actor_id.hex()[:12] if self.handle is not None else "?"
        if self.where is None:
            return f"Ray actor {actor}"
        return f"Ray actor {actor} on node {self.where.node[:12]} ({self.where.host})"

    def name(self) -> str:
        pid = f", pid {self.where.pid}" if self.where is not None else ""
        return f"worker {self.id} ({self.actor()}{pid})"


class RaySupervisor:
    """``num_workers`` Ray actors for ``spec``, with the :class:`~aioloader.workers._supervisor.
    Supervisor`'s interface (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, num_workers: int, *,
                 budget: RestartBudget | None = None, skips: SkipLog | None = None) -> None:
        self.spec = spec
        self.num_workers = num_workers
        self.budget = budget if budget is not None else RestartBudget()
        self.skips = skips if skips is not None else SkipLog()
        self.last_heard = time.monotonic()
        self.actors: list[_Actor] = []
        self.failure: BaseException | None = None
        self.closed = False
        self._stream = spec.plan != "index"
        self._slots = spec.workers.slots
        self._spec_ref: Any = None  # the spec, put once in the object store for every actor
        self._cls: Any = None
        self._retired: list[_Actor] = []  # replaced actors: killed, confirmed at close
        self._awaited: int | None = None  # the worker whose reply the consumer waits for
        self._restarting = False  # a replacement's start is awaited: that is no silence

    # ------------------------------------------------------------------ start

    def _options(self) -> dict[str, Any]:
        given = dict(self.spec.workers.ray_options or {})
        given.setdefault("num_cpus", 1)
        # Calls wait for their turn in the actor: as many may be in flight as a window holds.
        return {**given, "max_restarts": 0, "max_task_retries": 0,
                "max_concurrency": max(64, 4 * self.num_workers * self._slots)}

    async def start(self) -> None:
        """Connect to Ray (``ray.init()`` unless the caller did), put the spec in the
        object store once, start every actor and wait until each says where it runs."""
        ray = _ray()
        try:
            if not ray.is_initialized():
                # The caller's context when there is one (ray.init(address=...) or
                # RAY_ADDRESS); else a local Ray, as ray.init() starts it. Seconds, so not
                # on the loop; and on the thread that lives as long as the process, not a
                # throwaway one: see _on_init_thread (issue 22 audit).
                await asyncio.wrap_future(_on_init_thread(_init))
            try:
                self._spec_ref = ray.put(self.spec)
            except Exception as exc:
                raise SourcePicklingError(
                    f"the worker spec (source {type(self.spec.source).__name__}) cannot be "
                    f"sent to Ray actors: {exc!r}. Make the source, collate_fn and "
                    "worker_init_fn picklable with cloudpickle") from exc
            self._cls = ray.remote(RayWorker).options(**self._options())
            for k in range(self.num_workers):
                self.actors.append(self._spawn(k))
            for a in self.actors:
                await self._greet(a)
        except BaseException:
            await self.aclose(0.0)
            raise

    def _spawn(self, worker_id: int, start: ShardPosition | None = None) -> _Actor:
        handle = self._cls.remote(self._spec_ref, worker_id, start)
        a = _Actor(worker_id, handle, handle.hello.remote())
        self._top_up(a)  # a stream's first batches are built while the others start
        return a

    async def _greet(self, a: _Actor) -> None:
        """Wait until ``a`` says where it runs (its start). Its death before that is a
        death like a later one: within ``max_worker_restarts`` ``a`` is lost and its
        next ``receive`` raises WorkerLost, else it is the session's ``WorkerDied``."""
        ray = _ray()
        # Ray's own future of the ref, not ensure_future(ref): that wrapped the ref in a
        # coroutine whose frame, in the traceback of Ray's error, held the ObjectRef, and
        # the error and this frame made a cycle: the dead actor's reply stayed owned after
        # close until a gc (issue 22 audit). The error is read with exception(), never
        # raised here: it carries no traceback, so no frame of ours holds or is held.
        hello: asyncio.Future[Hello] = asyncio.wrap_future(a.hello.future())
        a.hello = None
        try:
            # Ray waits without a word to us: say why, after 30 s, 90 s, 210 s...
            began, patience = time.monotonic(), PLACEMENT_PATIENCE
            while not (await asyncio.wait({hello}, timeout=patience))[0]:
                await self._say_why_not_running(a, time.monotonic() - began)
                patience *= 2
        finally:
            hello.cancel()  # (cancelled while waiting: nobody will read it)
        error = hello.exception()
        if error is None:
            a.where = hello.result()
            a.born = time.monotonic()
            self.last_heard = a.born
            return
        del hello
        if not isinstance(error, ray.exceptions.RayError):
            raise error
        dead = isinstance(error, ray.exceptions.ObjectLostError) or (
            isinstance(error, ray.exceptions.RayActorError) and not error.actor_init_failed)
        if not dead:  # its creation task raised (the spec did not load there): no restart heals
            raise self._died(a, error) from error
        # Killed before it said where it ran (in worker_init_fn, say): the budget decides,
        # as for any death; processes heal it, and so must we (issue 22 audit). Ray's
        # actor table names its node and pid, as a Hello would have.
        a.where = await _looked_up(a.handle)  # (None before: it never said)
        lost = self._death(a, error)
        if not isinstance(lost, WorkerLost):
            raise lost from error

    async def _say_why_not_running(self, a: _Actor, waited: float) -> None:
        """Warn that ``a`` has not started after ``waited`` seconds, and why: Ray has no node
        with what it asks for free, or it has placed it and its process is still starting
        (on a busy 2-core machine, actors importing torch took over 30 s)."""
        where = await _looked_up(a.handle)
        if where is None:
            log.warning("%s is not running after %.0f s: Ray has no node with what it asks "
                        "for free yet (%s); see `ray status`", a.name(), waited,
                        self._options())
        else:
            log.warning("%s is not running after %.0f s: Ray placed it on node %s (%s, pid "
                        "%d), where its process is still starting (importing the source's "
                        "modules, its worker_init_fn, or a busy machine); see `ray status`",
                        a.name(), waited, where.node, where.host, where.pid)

    def _top_up(self, a: _Actor) -> None:
        """A stream: keep ``slots`` calls in flight, each a batch once it is built."""
        if not self._stream or self.closed or a.successor is not None:
            return  # (retired: what it owes is the successor's)
        while len(a.calls) < self._slots:
            a.calls.append(a.handle.next.remote(a.number()))

    # ------------------------------------------------------------------ deliver

    def request(self, worker_id: int, seq: int, indices: list[int]) -> None:
        """Ask worker ``worker_id`` for the batch of ``indices``, numbered ``seq`` (the
        producer bounds how many are in flight); once it retires, its successor is asked."""
        if self.closed:
            return
        a = self.actors[worker_id]
        while a.successor is not None:
            a = a.successor
        a.calls.append(a.handle.fetch.remote(a.number(), seq, indices))

    async def receive(self, worker_id: int, *, lease: bool = True) -> Arrival:
        """The next batch or pass end of worker ``worker_id``, in the order it built them.

        Raises the session's failure, :class:`LoaderClosedError` once closed, and
        :class:`~aioloader.workers._phases.WorkerLost` when the worker died within the budget.
        """
        ray = _ray()
        while True:
            if self.failure is not None:
                raise self.failure
            if self.closed:
                raise LoaderClosedError("the loader was closed")
            a = self.actors[worker_id]
            if a.lost is not None:
                raise WorkerLost(worker_id)
            if not a.calls:
                if a.successor is not None:  # recycling: what the old one owed is taken
                    await self._switch(worker_id)
                    continue
                self._top_up(a)
                assert a.calls, f"receive() from worker {worker_id} with nothing requested"
            self._awaited = worker_id
            try:
                reply = await _first_reply(a)
            finally:
                self._awaited = None
            a.heard = time.monotonic()
            if isinstance(reply, (ray.exceptions.RayActorError,
                                  ray.exceptions.ObjectLostError)):
                raise self._death(a, reply) from reply
            if isinstance(reply, BaseException):
                self.failure = WorkerError(f"{a.name()}: Ray failed to deliver its batch: "
                                           f"{reply}", worker_id=a.id, pid=_pid(a))
                raise self.failure from reply
            if self.closed:
                raise LoaderClosedError("the loader was closed")
            a.calls.popleft()
            self.last_heard = time.monotonic()
            got = self._accept(a, reply, lease and self.spec.workers.zero_copy)
            self._top_up(a)
            if got is not None:
                return got

    def _accept(self, a: _Actor, reply: Reply, views: bool) -> Arrival | None:
        """What ``reply`` hands over; ``views``: its tensors may stay views of the object
        store (zero-copy), else they are copied out (``zero_copy=False``, a cache)."""
        if isinstance(reply, Raised):
            self.failure = self._worker_error(a, reply)
            raise self.failure
        for s in reply.skipped:
            self.skips.add(SkippedLoad(s.key, a.id, s.attempts, s.error))
        if isinstance(reply, Retire):  # a stream's hand-over: the rest is the successor's
            a.calls.clear()
            a.successor = self._successor(a, reply.position)
            return None
        a.busy = reply.busy
        if isinstance(reply, PassOver):
            return Ended(reply.pass_no)
        a.batches += 1
        a.last = time.monotonic()
        if reply.retire and a.successor is None:  # index batches: new tasks go to the next
            a.successor = self._successor(a, None)
        value = reply.value if views else copy.deepcopy(reply.value)
        return Received(value, reply.seq, reply.mark, reply.nbytes)

    def _successor(self, a: _Actor, start: ShardPosition | None) -> _Actor:
        self.budget.recycles += 1
        log.info("%s is retiring (recycle %d); its successor starts", a.name(),
                 self.budget.recycles)
        return self._spawn(a.id, start)

    async def _switch(self, worker_id: int) -> None:
        old = self.actors[worker_id]
        new = old.successor
        assert new is not None
        old.successor = None
        self._let_go(old)
        self.actors[worker_id] = new
        await self._greet(new)

    # ------------------------------------------------------------------ faults

    def _died(self, a: _Actor, exc: BaseException) -> WorkerDied:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return WorkerDied(a.id, _pid(a), None,
                          f"its {a.actor()} is gone ({type(exc).__name__}: {first})",
                          hung=a.silenced)

    def heal(self, silence: float) -> bool:
        """As :meth:`Supervisor.heal <aioloader.workers._supervisor.Supervisor.heal>`: the actor the
        consumer waits for, silent ``silence`` seconds, is killed (``ray.kill``) and its
        death healed like any other. An actor says nothing while it builds a batch, so a
        batch that takes longer than ``timeout`` counts as a hang here."""
        if self._restarting:
            return True
        k = self._awaited
        if k is None or self.closed or self.failure is not None or not self.budget.room:
            return False
        a = self.actors[k]
        if a.silenced is not None and a.lost is None:
            return True  # killed already: its death is on its way
        quiet = time.monotonic() - max(a.heard, a.born)
        if a.lost is not None or a.silenced is not None or quiet < silence:
            return False
        a.silenced = quiet
        log.warning("%s hung: no reply for %.1f s (timeout=%s) while the consumer waited "
                    "for its batch; killing its actor to replace it", a.name(), quiet, silence)
        _ray().kill(a.handle, no_restart=True)
        return True

    def _death(self, a: _Actor, exc: BaseException) -> BaseException:
        """``a`` died (or its batch went with its node): lost within the budget, else the
        session's failure."""
        died = self._died(a, exc)
        fatal = self.budget.spend(died)
        if fatal is not None:
            self.failure = fatal
            return fatal
        a.lost = died
        return WorkerLost(a.id)

    async def restart(self, worker_id: int, start: ShardPosition | None = None) -> None:
        """Replace worker ``worker_id``, which died, by a new actor with the same shard and
        seeds; a stream's starts at ``start``. Index batches in flight are asked again by
        the producer."""
        old = self.actors[worker_id]
        assert old.lost is not None, f"worker {worker_id} is not lost"
        self.budget.healing(old.lost)
        log.warning("%s; restarting it (restart %d of max_worker_restarts=%d)%s", old.lost,
                    len(self.budget.deaths), self.budget.limit,
                    f", from pass {start.pass_no} block {start.start.block}"
                    if start is not None else "")
        self._let_go(old)
        new = self._spawn(worker_id, start)
        self.actors[worker_id] = new
        self._restarting = True
        try:
            await self._greet(new)
        finally:
            self._restarting = False

    def _let_go(self, a: _Actor) -> None:
        """Kill ``a`` (and a successor it started) and drop its calls: their batches leave
        the object store with the last reference."""
        for x in _chain(a):
            x.calls.clear()
            with contextlib.suppress(Exception):
                _ray().kill(x.handle, no_restart=True)
            self._retired.append(x)

    def _worker_error(self, a: _Actor, msg: Raised) -> WorkerError:
        original: BaseException | None = None
        if msg.pickled is not None:
            with contextlib.suppress(Exception):
                original = pickle.loads(msg.pickled)
        err = worker_error_for(
            original if isinstance(original, BaseException) else None,
            f"{a.name()} raised {msg.error_repr}\n\n  Traceback from the worker:\n  "
            + msg.traceback.rstrip().replace("\n", "\n  "), worker_id=a.id, pid=_pid(a))
        if isinstance(original, BaseException):
            err.__cause__ = original
        return err

    # ------------------------------------------------------------------ watch, report

    def attach(self) -> None:
        """Nothing to watch: an awaited ObjectRef wakes whichever loop awaits it."""

    def detach(self) -> None:
        pass

    def stats(self) -> tuple[tuple[WorkerStats, ...], ArenaStats]:
        """Each worker's telemetry (its node too); no arena: batches go through Ray."""
        workers = tuple(
            WorkerStats(a.id, _pid(a), a.batches,
                        a.batches / max(a.last - a.born, 1e-9) if a.batches else 0.0,
                        min(a.busy / max(a.last - a.born, 1e-9), 1.0) if a.batches else 0.0,
                        node=a.where.node if a.where is not None else None)
            for a in list(self.actors))
        in_flight = sum(len(a.calls) for a in self.actors)
        slots = self._slots * len(self.actors)
        return workers, ArenaStats(slots, max(slots - in_flight, 0), in_flight, 0, 0)

    def describe(self, worker_ids: list[int]) -> str:
        return ", ".join(self.actors[k].name() for k in worker_ids)

    # ------------------------------------------------------------------ stop

    def _begin_close(self) -> list[Any] | None:
        """Kill every actor and drop every call; the handles whose death to confirm."""
        if self.closed:
            return None
        self.closed = True
        everyone = [x for a in self.actors for x in _chain(a)] + self._retired
        self._retired = []
        handles = []
        for a in everyone:
            a.calls.clear()
            a.hello = None
            if a.handle is None:
                continue
            with contextlib.suppress(Exception):
                _ray().kill(a.handle, no_restart=True)
            handles.append(a.handle)
        self._spec_ref = None
        return handles

    def _confirm(self, handles: list[Any]) -> list[Any]:
        """One call per killed actor: Ray fails it once the actor is dead for sure."""
        ray = _ray()
        if not handles or not ray.is_initialized():
            return []
        return [h.hello.remote() for h in handles]

    async def aclose(self, grace: float) -> None:
        """Kill every actor and wait (without blocking the loop) until Ray says they are
        dead, so that no actor and no batch outlives the close."""
        handles = self._begin_close()
        if handles is None:
            return
        await _settled(self._confirm(handles), CLOSE_WAIT + grace)
        del handles

    def close(self, grace: float) -> None:
        """Blocking version of :meth:`aclose`."""
        handles = self._begin_close()
        if handles is None:
            return
        with contextlib.suppress(Exception):
            _wait_and_drop(self._confirm(handles), CLOSE_WAIT + grace)
        del handles


async def _settled(refs: list[Any], timeout: float) -> None:
    """Wait up to ``timeout`` for every ObjectRef of ``refs`` to resolve, raising nothing;
    ``refs`` is empty after.

    Blocking, in a thread, and the refs dropped there: nothing may hold one once this
    returns. An awaited ref resolves from a callback on Ray's own thread, which still
    held the ref for a moment after this loop saw the result, and an executor's call
    holds its arguments a moment after its result is out: a close returned with its
    probes still owned here (1-5 closes of 25 on the 2-core machine beside one busy
    process; tests/test_ray.py).
    """
    if refs:
        await asyncio.to_thread(_wait_and_drop, refs, timeout)


def _wait_and_drop(refs: list[Any], timeout: float) -> None:
    """Block until every ref of ``refs`` resolved (``timeout`` at most), then empty it."""
    try:
        if refs:
            with contextlib.suppress(Exception):
                _ray().wait(refs, num_returns=len(refs), timeout=timeout)
    finally:
        refs.clear()


async def _first_reply(a: _Actor) -> Reply | BaseException:
    """The reply of ``a``'s first call in flight, or Ray's error for it. The error is
    returned, not raised: its traceback would hold this frame, and the frame the
    ObjectRef, whose batch would then stay in the store as long as the error lives."""
    ref = a.calls[0]
    try:
        return cast("Reply", await ref)
    except _ray().exceptions.RayError as exc:
        error: BaseException = exc
        return error
    finally:
        del ref


async def _looked_up(handle: Any) -> Hello | None:
    """:func:`_where_it_was`, off the loop, within ``LOOKUP_WAIT``; None where Ray does not
    say in time (or fails to)."""
    with contextlib.suppress(Exception):
        return await asyncio.wait_for(asyncio.to_thread(_where_it_was, handle), LOOKUP_WAIT)
    return None


def _where_it_was(handle: Any) -> Hello | None:
    """Where the actor of ``handle`` ran, as Ray's actor table says (for one that died
    before its Hello); None where Ray does not know. Blocking: GCS calls."""
    ray = _ray()
    # (private: no public call of Ray 2.60 gives a dead actor's node and pid)
    info = ray._private.state.actors(actor_id=handle._actor_id.hex())
    node: str = info.get("Address", {}).get("NodeID", "")
    pid: int = info.get("Pid", 0)
    if not pid or not node.strip("f"):  # (never placed: no pid, a nil node ID)
        return None
    host = next((n.get("NodeManagerHostname", "?") for n in ray.nodes()
                 if n.get("NodeID") == node), "?")
    return Hello(node, host, pid)


def _init() -> None:
    ray = _ray()
    if not ray.is_initialized():  # (another loader's start may have come first)
        ray.init(ignore_reinit_error=True, log_to_driver=True)


_Job = tuple[Callable[[], None], concurrent.futures.Future[None]]
_init_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_init_thread: threading.Thread | None = None
_init_lock = threading.Lock()


def _on_init_thread(job: Callable[[], None]) -> concurrent.futures.Future[None]:
    """Run ``job`` (``ray.init``) on the thread kept for the process's life.

    Ray starts its node's processes (GCS, raylet, agents) with PR_SET_PDEATHSIG, which
    fires when the *thread* that started them exits. Started from asyncio.to_thread, they
    died with that thread (at the sync face's close, at the end of asyncio.run): the next
    loader's Ray call ended the process, or hung, and agents orphaned by the killed raylet
    lingered for minutes after the program (issue 22 audit). A daemon, as the main thread
    would be: threading's shutdown joins executor threads *before* atexit runs Ray's own
    ``ray.shutdown()``, which stops those processes in order; this thread ends only with
    the process.
    """
    global _init_thread
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    with _init_lock:
        if _init_thread is None or not _init_thread.is_alive():  # (none yet, or forked)
            _init_thread = threading.Thread(target=_serve_init, name="aioloader-ray-init",
                                            daemon=True)
            _init_thread.start()
        _init_jobs.put((job, done))
    return done


def _serve_init() -> None:
    while True:
        job, done = _init_jobs.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise
            done.set_exception(exc)
        else:
            done.set_result(None)


def _chain(a: _Actor) -> Iterator[_Actor]:
    x: _Actor | None = a
    while x is not None:
        yield x
        x = x.successor


def _pid(a: _Actor) -> int | None:
    return a.where.pid if a.where is not None else None
