"""The resume workload: seconds from ``load_state_dict`` to the first batch, at several positions.

A map-style epoch of ``items`` cheap samples (``Counted``: an 8-float tensor per index, each
``__getitem__`` counted), shuffled, batch size 64, is resumed at 0 %, 10 %, 50 % and 90 % of
the epoch by aioloader's ``DataLoader`` and by torchdata's ``StatefulDataLoader`` (same
dataset, workers, batch size and start method). Each measurement runs in a fresh forked
process: build the loader, then time ``load_state_dict(state)`` + ``next(iter(loader))``,
and count the ``__getitem__`` calls made by then, in every process. A loader that resumes
without fetching the skipped samples makes the same count at every position.

The state to load: consuming 90 % of a million-item epoch takes far longer than the resume
it measures, so by default (``state_from="edit"``) each side's state is taken after one
batch and its position fields are set to the target: aioloader's ``batches_in_pass`` and
``batches_in_epoch``; torchdata's batch counters (``_num_yielded`` /
``_snapshot_step``, ``_sampler_iter_yielded``), its sampler's ``samples_yielded`` and
``yielded``, and with workers the ``_last_yielded_worker_id`` of the round robin. Every run
checks that method first: resumed at ``CHECK_AT`` batches, an edited and a consumed state must
give the same first batch. ``state_from="consume"`` consumes to each position instead.
"""

from __future__ import annotations

import copy
import gc
import importlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

import aioloader

from ._runner import isolated_call

Result = dict[str, Any]
StateFrom = Literal["edit", "consume"]
RESUME = "resume"  # the workload's name on the command line
SIDES = ("aioloader", "torchdata")
DEFAULT_ITEMS = 1_000_000
QUICK_ITEMS = 20_000
DEFAULT_POSITIONS = (0.0, 0.1, 0.5, 0.9)
DEFAULT_BATCH_SIZE = 64
SEED = 1234
CHECK_AT = 3  # batches: where the edited state is checked against a consumed one
FIRST = 8  # indices of the first batch kept in each result


class Counted(Dataset[dict[str, Any]]):
    """``{"i": idx, "x": 8 floats}``; every ``__getitem__`` appends a byte to ``counter``.

    An O_APPEND file counts across every process, whatever the start method (the dataset
    pickles as its two fields).
    """

    def __init__(self, n: int, counter: str) -> None:
        self.n = n
        self.counter = counter

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict[str, Any]:
        key = (os.getpid(), self.counter)
        fd = _COUNTER_FDS.get(key)
        if fd is None:
            fd = _COUNTER_FDS[key] = os.open(self.counter,
                                             os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"\0")
        return {"i": idx, "x": torch.full((8,), float(idx))}


_COUNTER_FDS: dict[tuple[int, str], int] = {}


@dataclass(frozen=True)
class ResumePlan:
    """The options of one resume measurement series."""

    items: int = DEFAULT_ITEMS
    batch_size: int = DEFAULT_BATCH_SIZE
    num_workers: int = 2
    start_method: str = "fork"
    positions: tuple[float, ...] = DEFAULT_POSITIONS  # fractions of the epoch
    repeats: int = 3
    timeout: float = 300.0  # seconds one measurement may take
    state_from: StateFrom = "edit"

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.items / self.batch_size)

    def targets(self) -> list[int]:
        """The positions in batches (each leaves at least one batch to resume to)."""
        last = self.batches_per_epoch - 1
        return [min(last, round(p * self.batches_per_epoch)) for p in self.positions]


def torchdata_missing() -> str | None:
    """Why torchdata's side cannot run here, or None."""
    try:
        _stateful_dataloader()
    except ImportError as exc:
        return f"torchdata is not installed ({exc}); its column is left out"
    return None


def _stateful_dataloader() -> Any:
    # imported by name: torchdata is optional and ships no type information
    return importlib.import_module("torchdata.stateful_dataloader").StatefulDataLoader


# ----------------------------------------------------------------- one side, in this process

def build(side: str, plan: ResumePlan, counter: str) -> Any:
    """The loader of ``side`` over ``Counted(plan.items)``, the same on both sides."""
    dataset = Counted(plan.items, counter)
    if side == "aioloader":
        return aioloader.DataLoader(dataset, batch_size=plan.batch_size, shuffle=True,
                                    seed=SEED, num_workers=plan.num_workers,
                                    start_method=plan.start_method, quiet=True)
    # torchdata 0.11 warns on every iterator under torch >= 2.9 (torch.set_vital is deprecated)
    warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
    generator = torch.Generator()
    generator.manual_seed(SEED)
    return _stateful_dataloader()(
        dataset, batch_size=plan.batch_size, shuffle=True, generator=generator,
        num_workers=plan.num_workers,
        multiprocessing_context=plan.start_method if plan.num_workers else None)


def _close(side: str, loader: Any) -> None:
    if side == "aioloader":
        loader.close()
    del loader
    gc.collect()  # torchdata: the iterator's workers go with it


def set_position(side: str, state: dict[str, Any], batches: int,
                 plan: ResumePlan) -> dict[str, Any] | None:
    """``state`` (taken after one batch) moved to ``batches`` batches into the epoch; None
    when its format has no position field we know."""
    state = copy.deepcopy(state)
    samples = batches * plan.batch_size
    if side == "aioloader":
        if not {"batches_in_pass", "batches_in_epoch"} <= state.keys():
            return None
        state["batches_in_pass"] = state["batches_in_epoch"] = batches
        return state
    if "_snapshot" in state:  # workers: the last snapshot (every step by default)
        snapshot = state["_snapshot"]
        snapshot["_snapshot_step"] = batches
        snapshot["_last_yielded_worker_id"] = (batches - 1) % plan.num_workers
        main = snapshot["_main_snapshot"]
        if state.get("_steps_since_snapshot"):
            return None
    else:
        main = state
        main["_num_yielded"] = batches
    main["_sampler_iter_yielded"] = batches
    sampler = main["_sampler_iter_state"]
    sampler["samples_yielded"] = samples
    sampler["sampler_iter_state"]["yielded"] = samples
    return state


def prepare(side: str, plan: ResumePlan, batches: int, how: StateFrom,
            workdir: str) -> Result:
    """Write the state of ``side`` at ``batches`` batches into the epoch to a file."""
    counter = os.path.join(workdir, f"prep-{side}-{os.getpid()}.count")
    loader = build(side, plan, counter)
    if batches == 0:
        state, used = loader.state_dict(), "fresh"
    else:
        taken = batches if how == "consume" else 1
        it = iter(loader)
        for _ in range(taken):
            next(it)
        state, used = loader.state_dict(), "consume"
        if taken != batches:
            edited = set_position(side, state, batches, plan)
            if edited is None:  # an unknown format: consume the rest after all
                for _ in range(batches - taken):
                    next(it)
                state = loader.state_dict()
            else:
                state, used = edited, "edit"
        del it
    _close(side, loader)
    path = os.path.join(workdir, f"state-{side}-{batches}-{how}.pt")
    if side == "aioloader":
        json.dumps(state)  # the contract: JSON-able
    torch.save(state, path)
    return {"path": path, "made_by": used}


def measure(side: str, plan: ResumePlan, state_path: str, workdir: str) -> Result:
    """Build a loader, then time ``load_state_dict`` + the first batch; count fetches."""
    counter = os.path.join(workdir, f"measure-{side}-{os.getpid()}.count")
    state = torch.load(state_path, weights_only=False)
    loader = build(side, plan, counter)
    open(counter, "wb").close()
    t0 = time.perf_counter()
    loader.load_state_dict(state)
    t1 = time.perf_counter()
    it = iter(loader)
    batch = next(it)
    t2 = time.perf_counter()
    fetched = os.path.getsize(counter)
    first = batch["i"][:FIRST].tolist()
    del it, batch
    _close(side, loader)
    return {"seconds": t2 - t0, "load_s": t1 - t0, "getitem": fetched, "first": first}


# ------------------------------------------------------------------------------ the series

def run_resume(plan: ResumePlan, sides: Sequence[str],
               note: Callable[[str], None] = lambda _: None) -> Result:
    """States, the edit check, then ``plan.repeats`` rounds over positions and sides."""
    workdir = tempfile.mkdtemp(prefix="aioloader-bench-resume-")
    try:
        def call(fn: Callable[..., Result], *args: Any, what: str) -> Result:
            return isolated_call(fn, (*args, workdir), plan.timeout, what)

        checks: dict[str, Result] = {}
        if plan.state_from == "edit":
            for side in sides:
                got = {how: call(measure, side, plan,
                                 call(prepare, side, plan, CHECK_AT, how,
                                      what=f"{side}: state at {CHECK_AT} ({how})")["path"],
                                 what=f"{side}: check ({how})")["first"]
                       for how in ("consume", "edit")}
                checks[side] = {"ok": got["consume"] == got["edit"], **got}
                note(f"{side}: edited state at batch {CHECK_AT} resumes like a consumed one: "
                     f"{'yes' if checks[side]['ok'] else 'NO'}")
        states = {(side, k): call(prepare, side, plan, k, plan.state_from,
                                  what=f"{side}: state at batch {k}")
                  for side in sides for k in plan.targets()}
        made_by = {f"{side}@{k}": s["made_by"] for (side, k), s in states.items()}
        runs: dict[str, dict[int, list[Result]]] = {s: {k: [] for k in plan.targets()}
                                                    for s in sides}
        for repeat in range(plan.repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for k in plan.targets():
                for side in order:
                    result = call(measure, side, plan, states[side, k]["path"],
                                  what=f"{side}: resume at batch {k}")
                    runs[side][k].append(result)
            note(f"resume: round {repeat + 1} of {plan.repeats} done")
        return {"checks": checks, "made_by": made_by,
                "runs": {s: {str(k): v for k, v in r.items()} for s, r in runs.items()}}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------- report

def summary_rows(plan: ResumePlan, raw: Result) -> list[Result]:
    """Per position: medians of each side, aioloader/torchdata over repeats, fetch counts."""
    rows = []
    for fraction, k in zip(plan.positions, plan.targets(), strict=True):
        row: Result = {"position": fraction, "batch": k}
        for side, results in raw["runs"].items():
            runs = results[str(k)]
            row[f"{side}_s"] = statistics.median(r["seconds"] for r in runs)
            row[f"{side}_getitem"] = max(r["getitem"] for r in runs)
        if {"aioloader", "torchdata"} <= raw["runs"].keys():
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(
                raw["runs"]["aioloader"][str(k)], raw["runs"]["torchdata"][str(k)],
                strict=True)]
            row.update(ratio=statistics.median(ratios), ratio_min=min(ratios),
                       ratio_max=max(ratios))
        rows.append(row)
    return rows


def table(plan: ResumePlan, rows: Sequence[Result]) -> str:
    """The resume table, plain text."""
    def cell(row: Result, key: str, fmt: str) -> str:
        return format(row[key], fmt) if row.get(key) is not None else "-"

    head = ("position", "batch", "aioloader s", "torchdata s", "ratio (min-max)",
            "aioloader getitem", "torchdata getitem")
    cells = [(f"{row['position']:.0%}", str(row["batch"]), cell(row, "aioloader_s", ".3f"),
              cell(row, "torchdata_s", ".3f"),
              f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
              if "ratio" in row else "-",
              cell(row, "aioloader_getitem", "d"), cell(row, "torchdata_getitem", "d"))
             for row in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    lines = [f"resume: {plan.items} items, batch_size {plan.batch_size}, "
             f"{plan.batches_per_epoch} batches/epoch, num_workers={plan.num_workers}, "
             f"start_method={plan.start_method}, state from: {plan.state_from}; seconds from "
             f"load_state_dict to the first batch (median of {plan.repeats}, each in a fresh "
             "process); getitem: __getitem__ calls by then (max)"]
    for c in [head, *cells]:
        lines.append("  ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}"
                               for i, (v, w) in enumerate(zip(c, widths, strict=True))))
    return "\n".join(lines)
