"""The run's phase: where a loader stands between and during its epochs, and the only moves.

The table is data, in one place (``TRANSITIONS``); :func:`advance` is the one way to move, and
it refuses a move the table does not hold, naming the phase and the event (trio's and
httpcore's state machines work so). Pure: no loop, no lock (the run calls it under its own).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    IDLE = "idle"  # between epochs, nothing owed (a session may be kept for the next)
    IN_EPOCH = "in an epoch"  # an epoch is current (or was dropped half-way, unfinished)
    ALL_HANDED = "all handed over"  # the current epoch handed over all its batches: its
    #                                 pass end is owed until it takes it or ends
    PASS_OWED = "a pass end owed"  # that epoch was closed: the next one takes its pass end
    REWIND_OWED = "a rewind owed"  # an epoch left early kept its workers: start it again
    CLOSING = "closing"  # a close runs, in some task or thread: no epoch may begin
    CLOSED = "closed"  # nothing kept, nothing running; an epoch may begin anew


class Event(enum.Enum):
    BEGIN = "an epoch begins"
    LAST_BATCH = "the epoch hands over its last batch (as many as its length says)"
    PASS_END = "the epoch takes its pass end"
    END = "the epoch ends (complete, or stopped by an error)"
    LEAVE = "its consumer closes the epoch (its workers stop, or its pass end stays owed)"
    KEEP = "its consumer closes the epoch early, its persistent workers kept"
    SET_EPOCH = "set_epoch() moves the next pass elsewhere"
    LOAD = "load_state_dict(): the state says where the next epoch starts"
    CLOSE = "close() or aclose() begins"
    CLOSED = "the last close running is over"


_P, _E = Phase, Event
_CURRENT = (_P.IN_EPOCH, _P.ALL_HANDED)  # an epoch is current (alive or dropped)
_BETWEEN = (_P.IDLE, _P.PASS_OWED, _P.REWIND_OWED)  # none is, nothing closes

# (from, event, to): every legal move; anything else is a bug in the run.
TRANSITIONS: tuple[tuple[Phase, Event, Phase], ...] = (
    # An epoch begins from anywhere but a close in progress: over a current one it
    # supersedes it (torch's second iter()); after a close it starts everything anew.
    *((p, _E.BEGIN, _P.IN_EPOCH) for p in (*_BETWEEN, *_CURRENT, _P.CLOSED)),
    (_P.IN_EPOCH, _E.LAST_BATCH, _P.ALL_HANDED),  # where the last batch is handed over
    (_P.ALL_HANDED, _E.LAST_BATCH, _P.ALL_HANDED),  # one past a len() that was off
    (_P.IN_EPOCH, _E.PASS_END, _P.IN_EPOCH),  # a stream's, whose length nobody knew
    (_P.ALL_HANDED, _E.PASS_END, _P.IN_EPOCH),  # paid: the epoch's end follows
    *((p, _E.END, _P.IDLE) for p in _CURRENT),
    (_P.IN_EPOCH, _E.LEAVE, _P.IDLE),  # left half-way: its workers stop
    (_P.ALL_HANDED, _E.LEAVE, _P.PASS_OWED),  # Lightning, zip(), islice(): the next pays
    (_P.IN_EPOCH, _E.KEEP, _P.REWIND_OWED),
    # set_epoch() makes another pass the next one: an owed pass end or rewind is void
    *((p, _E.SET_EPOCH, p) for p in (_P.IDLE, *_CURRENT, _P.CLOSING, _P.CLOSED)),
    (_P.PASS_OWED, _E.SET_EPOCH, _P.IDLE),
    (_P.REWIND_OWED, _E.SET_EPOCH, _P.IDLE),
    # (from a current phase: an epoch dropped half-way; a live one is refused before)
    *((p, _E.LOAD, _P.IDLE) for p in (*_BETWEEN, *_CURRENT)),
    (_P.CLOSED, _E.LOAD, _P.CLOSED),
    *((p, _E.CLOSE, _P.CLOSING) for p in Phase),  # from any task or thread
    (_P.CLOSING, _E.CLOSED, _P.CLOSED),
)

# (one move per pair: tests/test_run_phases.py checks it)
_TABLE: dict[tuple[Phase, Event], Phase] = {(f, e): t for f, e, t in TRANSITIONS}


class PhaseError(AssertionError):
    """An illegal move of the run's phase: a bug in aioloader, never the user's doing."""


def advance(phase: Phase, event: Event) -> Phase:
    """The phase after ``event`` in ``phase``; :class:`PhaseError` if the table has no move."""
    to = _TABLE.get((phase, event))
    if to is None:
        legal = ", ".join(e.name for (p, e) in _TABLE if p is phase)
        raise PhaseError(
            f"the run cannot take event {event.name} ({event.value}) in phase {phase.name}: "
            f"the table has no move for it (from {phase.name}: {legal}). This is a bug in "
            "aioloader; please report it with the traceback")
    return to


def table_rows() -> list[str]:
    """The table as docs/architecture.md shows it: ``| from | event | to |`` rows."""
    return [f"| {f.name} | {e.name} | {t.name} |" for f, e, t in TRANSITIONS]
