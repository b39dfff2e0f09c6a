"""The run's phase: its table, every (phase, event) pair, and a run driven through each move.

The table (``run/_phase.py``) is pure and is checked without a loop; the run is driven with
an in-process config (and, where a move needs workers, one worker process), its epochs
stood in for by tokens, as ``tests/test_session_unit.py`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import pathlib
import re
import threading
from typing import Any

import pytest
import torch

import aioloader
from aioloader import LoaderBusyError, LoaderClosedError
from aioloader.run._phase import TRANSITIONS, Event, Phase, PhaseError, advance, table_rows
from aioloader.run._run import Run
from aioloader.run._session import Session

DOCS = pathlib.Path(__file__).parent.parent / "docs" / "architecture.md"
MOVES = {(f, e): t for f, e, t in TRANSITIONS}
CURRENT = (Phase.IN_EPOCH, Phase.ALL_HANDED)


# ------------------------------------------------------------------ the table, pure


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)),
                         ids=lambda v: v.name)
def test_every_pair_moves_as_the_table_says_or_is_refused(phase: Phase, event: Event) -> None:
    if (phase, event) in MOVES:
        assert advance(phase, event) is MOVES[phase, event]
        return
    with pytest.raises(PhaseError) as refused:
        advance(phase, event)
    message = str(refused.value)
    assert f"event {event.name}" in message and f"in phase {phase.name}" in message


def test_the_table_has_one_move_per_pair_and_reaches_every_phase() -> None:
    assert len(MOVES) == len(TRANSITIONS)  # no (from, event) twice
    reached, frontier = {Phase.IDLE}, [Phase.IDLE]
    while frontier:
        here = frontier.pop()
        for (f, _), to in MOVES.items():
            if f is here and to not in reached:
                reached.add(to)
                frontier.append(to)
    assert reached == set(Phase)
    assert all((p, Event.CLOSE) in MOVES for p in Phase)  # a close from anywhere
    assert (Phase.CLOSING, Event.BEGIN) not in MOVES  # no epoch during a close


def test_the_docs_table_is_the_codes() -> None:
    text = DOCS.read_text()
    section = text[text.index("## The run's phase"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if re.match(r"\| [A-Z_]+ \|", line)]
    assert rows == table_rows()


# ------------------------------------------------------------------ a run, driven


class Token:
    """An epoch, as the run sees one."""

    def __init__(self) -> None:
        self.abandoned = self.superseded = self.waiting = False

    def abandon(self, superseded: bool = False) -> None:
        self.abandoned, self.superseded = True, superseded


def make_run(shuffle: bool = True, **options: Any) -> Run:
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=shuffle, seed=3,
                                  quiet=True, **options)
    return Run(loader.config)


def pass_of(epoch: int, **options: Any) -> list[list[int]]:
    """Pass ``epoch``'s batches, from a loader of its own."""
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True, **options)
    loader.set_epoch(epoch)
    with loader:
        return [b.tolist() for b in loader]


def current_iff_epoch_phase(run: Run) -> bool:
    return (run._epoch is not None) == (run.phase in CURRENT)


async def take(run: Run, session: Session, n: int) -> list[list[int]]:
    got = []
    for _ in range(n):
        step = await run.next(session)
        assert step is not None and not isinstance(step, BaseException)
        got.append(step.value.tolist())
    return got


async def test_a_complete_epoch_moves_through_last_batch_and_pass_end() -> None:
    run = make_run()
    token = Token()
    session = await run.begin(token, private=False)  # IDLE -BEGIN-> IN_EPOCH
    seen = [run.phase]
    for _ in range(3):
        assert await run.next(session) is not None
        seen.append(run.phase)
    assert seen == [Phase.IN_EPOCH, Phase.IN_EPOCH, Phase.IN_EPOCH, Phase.ALL_HANDED]
    assert current_iff_epoch_phase(run)
    assert await run.next(session) is None  # ALL_HANDED -PASS_END-> IN_EPOCH
    assert run.phase is Phase.IN_EPOCH
    await run.end(token, session, stop=False)  # IN_EPOCH -END-> IDLE
    assert run.phase is Phase.IDLE and current_iff_epoch_phase(run)
    assert run.owned.session is session and not session.closed  # kept for the next epoch
    await run.aclose()  # IDLE -CLOSE-> CLOSING -CLOSED-> CLOSED
    assert run.phase is Phase.CLOSED and current_iff_epoch_phase(run) and session.closed


async def test_an_epoch_ended_after_its_last_batch_goes_idle() -> None:
    run = make_run(batches_per_epoch=2)  # the epoch ends by count: no pass end read
    token = Token()
    session = await run.begin(token, private=False)
    await take(run, session, 2)
    assert run.phase is Phase.ALL_HANDED
    assert await run.next(session) is None
    await run.end(token, session, stop=False)  # ALL_HANDED -END-> IDLE
    assert run.phase is Phase.IDLE
    await run.aclose()


async def test_an_epoch_left_after_its_last_batch_owes_its_pass_end_once() -> None:
    run = make_run()
    first = Token()
    session = await run.begin(first, private=False)
    assert await take(run, session, 3) == pass_of(0)
    await run.leave(first, session)  # ALL_HANDED -LEAVE-> PASS_OWED
    assert run.phase is Phase.PASS_OWED and current_iff_epoch_phase(run)
    second = Token()
    session = await run.begin(second, private=False)  # PASS_OWED -BEGIN-> IN_EPOCH, paid
    assert run.phase is Phase.IN_EPOCH and not first.abandoned
    assert await take(run, session, 3) == pass_of(1)
    await run.aclose()


async def test_a_new_epoch_over_one_that_handed_all_takes_its_pass_end() -> None:
    run = make_run()
    first, second = Token(), Token()
    session = await run.begin(first, private=False)
    await take(run, session, 3)
    again = await run.begin(second, private=False)  # ALL_HANDED -BEGIN-> IN_EPOCH
    assert first.abandoned and not first.superseded  # it was over, not superseded
    assert await take(run, again, 3) == pass_of(1)
    await run.aclose()


async def test_an_epoch_left_half_way_stops_its_workers_and_the_pass_starts_again() -> None:
    run = make_run()
    token = Token()
    session = await run.begin(token, private=False)
    await take(run, session, 1)
    await run.leave(token, session)  # IN_EPOCH -LEAVE-> IDLE
    assert run.phase is Phase.IDLE and session.closed
    again = await run.begin(Token(), private=False)
    assert await take(run, again, 3) == pass_of(0)
    await run.aclose()


@pytest.mark.deadline(60)
async def test_persistent_workers_left_half_way_owe_a_rewind() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(6))
    loader = aioloader.DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True,
                                  quiet=True)
    run = Run(loader.config)
    token = Token()
    session = await run.begin(token, private=False)
    assert await run.next(session) is not None
    await run.leave(token, session)  # IN_EPOCH -KEEP-> REWIND_OWED
    assert run.phase is Phase.REWIND_OWED and not session.closed
    again = await run.begin(Token(), private=False)  # REWIND_OWED -BEGIN-> IN_EPOCH
    assert again is session  # the same workers, the pass from its start
    got = []
    while (step := await run.next(again)) is not None:
        assert not isinstance(step, BaseException)
        got.append(step.value[0].tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]
    await run.aclose()


@pytest.mark.deadline(60)
async def test_set_epoch_voids_an_owed_pass_end_whose_workers_are_gone() -> None:
    # persistent_workers=False: the workers stop as the epoch is left after its last
    # batch, so the owed pass end could only be counted, not read; set_epoch() moves the
    # next pass elsewhere, and that count would make the next epoch pass 2.
    run = make_run(num_workers=1, persistent_workers=False)
    token = Token()
    session = await run.begin(token, private=False)
    await take(run, session, 3)
    await run.leave(token, session)
    assert run.phase is Phase.PASS_OWED and session.closed
    run.set_epoch(1)  # PASS_OWED -SET_EPOCH-> IDLE
    assert run.phase is Phase.IDLE
    again = await run.begin(Token(), private=False)
    assert await take(run, again, 3) == pass_of(1)
    await run.aclose()


async def test_load_state_dict_during_a_live_epoch_is_refused_and_changes_nothing() -> None:
    run = make_run()
    token = Token()
    session = await run.begin(token, private=False)
    await take(run, session, 3)
    state = run.state_dict()
    with pytest.raises(LoaderBusyError):
        run.load_state_dict(state)  # ALL_HANDED, its epoch alive: refused
    assert run.phase is Phase.ALL_HANDED and run.is_current(token)
    await run.leave(token, session)
    run.load_state_dict(state)  # PASS_OWED -LOAD-> IDLE: nothing owed any more
    assert run.phase is Phase.IDLE and session.closed
    again = await run.begin(Token(), private=False)
    assert await run.next(again) is None  # the state was taken after the last batch
    await run.aclose()


async def test_a_close_counts_the_pass_end_of_an_epoch_that_handed_all() -> None:
    run = make_run()
    token = Token()  # alive, as zip() keeps the iterator
    session = await run.begin(token, private=False)
    await take(run, session, 3)
    await run.aclose()  # ALL_HANDED -CLOSE-> CLOSING -CLOSED-> CLOSED
    assert run.phase is Phase.CLOSED and current_iff_epoch_phase(run)
    again = await run.begin(Token(), private=False)  # CLOSED -BEGIN-> IN_EPOCH
    assert await take(run, again, 3) == pass_of(1)
    await run.aclose()


async def test_no_epoch_begins_while_a_close_runs_and_the_last_close_ends_it() -> None:
    run = make_run()
    release = threading.Event()
    entered = threading.Event()
    real_close = run.owned.close
    calls = 0

    def slow_close() -> None:  # the first close waits for the test; the others do not
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            assert release.wait(30)
        real_close()

    run.owned.close = slow_close  # type: ignore[method-assign]
    closer = threading.Thread(target=run.close)
    closer.start()
    assert entered.wait(30)
    assert run.phase is Phase.CLOSING
    with pytest.raises(LoaderClosedError, match="being closed"):
        await run.begin(Token(), private=False)
    run.close()  # a second close, over before the first: still CLOSING
    assert run.phase is Phase.CLOSING
    release.set()
    closer.join(30)
    assert not closer.is_alive() and run.phase is Phase.CLOSED
    session = await run.begin(Token(), private=False)  # a closed loader iterates again
    assert await take(run, session, 3) == pass_of(0)
    await run.aclose()


async def test_a_second_epoch_while_one_waits_for_a_batch_is_refused() -> None:
    run = make_run()
    token = Token()
    session = await run.begin(token, private=False)
    assert await run.next(session) is not None
    token.waiting = True  # its consumer, in another task, waits for a batch
    with pytest.raises(LoaderBusyError):
        await run.begin(Token(), private=False)
    assert run.is_current(token) and not token.abandoned
    await run.end(token, session, stop=True, grace=0.0)
    assert session.closed and run.phase is Phase.IDLE
    await run.aclose()


async def test_a_second_epoch_supersedes_one_half_consumed() -> None:
    run = make_run(shuffle=False)
    first, second = Token(), Token()
    session = await run.begin(first, private=False)
    assert await run.next(session) is not None
    again = await run.begin(second, private=False)
    assert first.abandoned and first.superseded and run.is_current(second)
    got = []
    while (step := await run.next(again)) is not None:
        got.append(step.value.tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]  # the pass again, from its start
    await run.end(second, again, stop=False)
    await run.aclose()


async def test_a_close_from_another_thread_ends_the_epoch_in_progress() -> None:
    run = make_run(batches_per_epoch=10**6)  # an epoch that never ends by itself
    token = Token()
    session = await run.begin(token, private=False)
    assert await run.next(session) is not None
    closer = threading.Thread(target=run.close)
    closer.start()
    with pytest.raises(LoaderClosedError):
        while True:  # steps until the close reaches the session
            await asyncio.wait_for(run.next(session), 30)
    await asyncio.to_thread(closer.join)
    await run.end(token, session, stop=True, grace=0.0)
    assert run.phase is Phase.CLOSED and session.closed


def epoch_of(loader: aioloader.DataLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def owing(loader: aioloader.DataLoader) -> None:
    """Take all of an epoch's batches and close it without asking for its end (as
    Lightning and zip() do): its pass end is owed."""
    it = iter(loader)
    assert [next(it).tolist() for _ in range(3)] == pass_of(0)
    it.close()  # type: ignore[attr-defined]


def test_a_close_with_a_pass_end_owed_then_set_epoch_counts_the_pass_once() -> None:
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    owing(loader)
    loader.close()
    loader.set_epoch(1)  # Lightning's call before the next epoch
    with loader:
        assert epoch_of(loader) == pass_of(1)


def test_a_loaded_state_is_where_the_next_epoch_starts_even_with_a_pass_end_owed() -> None:
    source = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    with source:
        it = iter(source)
        next(it)
        state = source.state_dict()  # after epoch 0's first batch
        it.close()  # type: ignore[attr-defined]
    loader = aioloader.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=3,
                                  quiet=True)
    owing(loader)
    loader.load_state_dict(state)
    with loader:
        assert epoch_of(loader) == pass_of(0)[1:]


@pytest.mark.parametrize(("phase", "event"),
                         [(p, e) for p, e in itertools.product(Phase, Event)
                          if (p, e) not in MOVES], ids=lambda v: v.name)
def test_the_run_refuses_every_illegal_move_and_stays_where_it_was(phase: Phase,
                                                                   event: Event) -> None:
    run = make_run()
    run.phase = phase  # (placed there directly: each illegal pair, whatever led to it)
    with run._lock, pytest.raises(PhaseError, match=f"event {event.name}"):
        run._move(event)
    assert run.phase is phase
    run.close()


def test_a_move_outside_the_lock_is_refused() -> None:
    run = make_run()
    with pytest.raises(AssertionError, match="under its lock"):
        run._move(Event.BEGIN)
    assert run.phase is Phase.IDLE
    run.close()


def test_loader_ray_options_is_a_read_only_view() -> None:
    pytest.importorskip("ray")
    given = {"num_cpus": 1, "resources": {"decode": 1}}
    loader = aioloader.DataLoader(list(range(4)), batch_size=2, worker_type="ray",
                                  ray_options=given, quiet=True)
    options = loader.ray_options
    assert options == given
    with pytest.raises(TypeError):
        options["num_cpus"] = 4  # type: ignore[index]
    given["num_cpus"] = 8  # the caller's dict is not the loader's either
    assert loader.ray_options is not None and loader.ray_options["num_cpus"] == 1
    with pytest.raises(AttributeError, match=r"DataLoader\.ray_options is fixed"):
        loader.ray_options = {}  # type: ignore[misc]
    assert aioloader.DataLoader(list(range(4)), quiet=True).ray_options is None
