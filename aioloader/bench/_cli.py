"""The ``aioloader bench`` command: options, the runs, the printed report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._options import validate_worker_nice
from . import _formats, _peers, _remote, _resume
from ._formats import FORMATS
from ._measure import Result, Spec
from ._remote import REMOTE
from ._report import (
    QUICK_NOTE,
    Row,
    Target,
    legend,
    machine_lines,
    summarise,
    table,
    target_lines,
    targets,
    targets_header,
)
from ._resume import RESUME, ResumePlan
from ._runner import (
    LAG_MIN_S,
    MeasurementError,
    Plan,
    default_batches,
    isolated,
    run_workload,
)
from ._step import FETCH
from ._workloads import ALL, FIRST, LAG, WORKLOADS, pillow_missing

DEFAULT_WORKLOADS = ALL
# these measure something else: only when asked for
CHOICES = (*ALL, FIRST, RESUME, REMOTE, FORMATS)
SPECIAL = (RESUME, REMOTE, FORMATS)


def _workloads(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CHOICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(map(repr, unknown)) or repr(text)}; "
            f"choose from {', '.join(CHOICES)}")
    return names


def _percents(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v.strip().rstrip("%")) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected percentages like 0,10,50,90, got {text!r}"
                                         ) from None
    if not values or any(not 0 <= v < 100 for v in values):
        raise argparse.ArgumentTypeError(f"each position must be in [0, 100), got {text!r}")
    return tuple(v / 100 for v in values)


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        return _remote.concurrency_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _step_ms(text: str) -> float | str:
    if text == FETCH:
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or {FETCH!r}, got {text!r}"
                                          ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 ms, got {text!r}")
    return value


def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``aioloader bench``."""
    parser.add_argument("--workloads", type=_workloads, default=DEFAULT_WORKLOADS,
                        help=f"comma-separated, from {','.join(CHOICES)} (default: "
                        f"{','.join(ALL)}); {FIRST!r} times DataLoader(...) to the first "
                        "batch of a fresh loader (with the --start-method given); "
                        f"{RESUME!r} times load_state_dict() to the first batch against "
                        "torchdata's StatefulDataLoader (--resume-* options); "
                        f"{REMOTE!r} fetches objects from a local HTTP server with 20 ms "
                        "latency: aioloader's load stage against torch and SPDL (--concurrency); "
                        f"{FORMATS!r} reads WebDataset shards and Parquet files against "
                        "webdataset's WebLoader and Hugging Face datasets")
    parser.add_argument("--num-workers", type=_at_least(0), default=2,
                        help="worker processes on both sides (default 2; 0 = in-process)")
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"),
                        default="fork", help="how both sides start workers (default fork)")
    parser.add_argument("--pairs", type=_at_least(1), default=None,
                        help="alternating aioloader/torch runs per workload, and rounds of "
                        "the resume workload (default 3)")
    parser.add_argument("--batches", type=_at_least(3), default=None,
                        help="batches per epoch for every workload (default: per workload)")
    parser.add_argument("--face", choices=("async", "sync"), default="async",
                        help="consume aioloader with `async for` (default) or `for`")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="event loop for the async runs (default asyncio)")
    parser.add_argument("--timeout", type=_at_least(1), default=300,
                        help="seconds one measurement may take before it is killed")
    parser.add_argument("--peers", action="store_true",
                        help="also run, in the same rounds, the peers that are installed: "
                        f"{', '.join(_peers.PEERS)} (SPDL pipelines on threads and on a "
                        "process pool; torchdata's StatefulDataLoader and a torchdata.nodes "
                        "pipeline); adds their columns and aioloader / best peer")
    parser.add_argument("--collate", choices=("none", "torch"), default="none",
                        help="'torch': pass collate_fn=torch.utils.data.default_collate "
                        "explicitly to every loader, where the workload has no collate of its "
                        "own (default none: each loader's default)")
    parser.add_argument("--lag", action="store_true",
                        help="also run each throughput workload, in the same pairs, with a 1 ms "
                        "ticker on the event loop beside aioloader's `async for` and beside "
                        "torch's loader iterated in the loop (`await asyncio.sleep(0)` between "
                        f"batches), each streaming at least {LAG_MIN_S:g} s; adds lag "
                        "p50/p99/max rows. Separate runs: the throughput rows are measured "
                        "without the ticker")
    parser.add_argument("--worker-nice", type=_at_least(0), default=None, metavar="N",
                        help="aioloader's worker_nice (0-19): its worker processes run N "
                        "nicer than the consumer's; the peers' workers are left as they are "
                        "(default: the loader's own, 19 when the workers are as many as the "
                        "usable cores, else 0)")
    parser.add_argument("--worker-type", choices=("process", "ray"), default="process",
                        help="aioloader's workers on the throughput workloads (default "
                        "process). 'ray': Ray actors on a local Ray started in each run "
                        "(pip install -e '.[ray]' in a clone); aioloader with worker "
                        "processes runs beside it in the same pairs, and the table adds Ray "
                        "against processes and Ray's cost per batch (docs/beyond.md)")
    parser.add_argument("--step-ms", type=_step_ms, default=None, metavar="MS",
                        help="after each batch, every side's consumer runs a step of about "
                        "MS ms of 128x128 matmuls (torch lets go of the GIL meanwhile, as "
                        "a training step on an accelerator does), calibrated once per "
                        "workload; 'fetch': each workload's step is about what building one "
                        "of its batches costs here (default: no step)")
    parser.add_argument("--step-threads", type=_at_least(0), default=0, metavar="N",
                        help="the --step-ms step's matmuls on N of torch's intra-op threads "
                        "(default 0: torch's count here, every core of a small machine, as a "
                        "training step on the CPU; 1: one core, as a step on an accelerator "
                        "leaves the rest free)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write raw results here")
    parser.add_argument("--quick", action="store_true",
                        help="tiny numbers: checks that everything runs, measures nothing "
                        "(the targets are listed, not judged: n/a)")
    parser.add_argument("--concurrency", type=_concurrency, default=None, metavar="LIST",
                        help=f"the {REMOTE} workload's loads in flight per worker (default "
                        f"{','.join(map(str, _remote.DEFAULT_CONCURRENCY))}; --quick: "
                        f"{','.join(map(str, _remote.QUICK_CONCURRENCY))})")
    resume = parser.add_argument_group(
        "the resume workload",
        "A shuffled map-style epoch of cheap samples is resumed at each position by aioloader "
        "and by torchdata's StatefulDataLoader (left out with a note when torchdata is not "
        "installed), each measurement in a fresh process: seconds from load_state_dict() to "
        "the first batch, and the __getitem__ calls made by then. States are taken after one "
        "batch and their position fields set to the target ('edit', checked against a "
        "consumed state first), or consumed to the position ('consume'). Both sides are "
        "consumed with `for`; --num-workers, --start-method, --pairs (rounds) and --timeout "
        "apply.")
    resume.add_argument("--resume-items", type=_at_least(2), default=None,
                        help=f"items in the epoch (default {_resume.DEFAULT_ITEMS:,}; "
                        f"--quick: {_resume.QUICK_ITEMS:,})")
    resume.add_argument("--resume-positions", type=_percents,
                        default=_resume.DEFAULT_POSITIONS, metavar="PERCENTS",
                        help="where to resume, in %% of the epoch (default 0,10,50,90)")
    resume.add_argument("--resume-batch-size", type=_at_least(1),
                        default=_resume.DEFAULT_BATCH_SIZE,
                        help=f"(default {_resume.DEFAULT_BATCH_SIZE})")
    resume.add_argument("--resume-state", choices=("edit", "consume"), default="edit",
                        help="how the state to load is made (default edit)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Measure, print the report, and write the JSON; 1 when a measurement failed."""
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            parser.error("--loop uvloop: uvloop is not installed")
    try:  # the loader's own rule, before any run starts; what the default comes to
        nice = validate_worker_nice(args.worker_nice, num_workers=args.num_workers,
                                    worker_type="process")
    except ValueError as exc:
        parser.error(f"--worker-nice {args.worker_nice}: {exc}")
    if args.worker_type == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            parser.error("--worker-type ray: Ray is not installed (pip install -e "
                         "'.[ray]' in a clone of aioloader)")
        if args.num_workers == 0:
            parser.error("--worker-type ray needs --num-workers 1 or more")
    batches = default_batches(args.quick)
    if args.batches is not None:
        batches = dict.fromkeys(batches, args.batches)
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 3)
    peers, notes = _peers.available(args.num_workers) if args.peers else ((), [])
    workloads = args.workloads
    if "decode" in workloads and (missing := pillow_missing()) is not None:
        notes.append(f"decode: skipped, {missing}")
        workloads = tuple(w for w in workloads if w != "decode")
    plan = Plan(num_workers=args.num_workers, start_method=args.start_method, pairs=pairs,
                batches=batches, face=args.face, loop=args.loop, timeout=float(args.timeout),
                peers=peers, collate=args.collate, lag=args.lag, worker_nice=args.worker_nice,
                lag_min_s=LAG_MIN_S / 10 if args.quick else LAG_MIN_S,
                worker_type=args.worker_type, step_ms=args.step_ms,
                step_threads=args.step_threads)
    if args.lag and not any(w in WORKLOADS for w in workloads):
        notes.append(f"--lag: no throughput workload to run beside ({', '.join(WORKLOADS)}); "
                     f"{LAG!r} measures image's lag on its own")
    started = time.monotonic()
    per_epoch = ", ".join(f"{w}={batches[w]}" for w in workloads
                          if w not in (*SPECIAL, FIRST))
    header = (f"aioloader bench: num_workers={plan.num_workers}, "
              f"start_method={plan.start_method}, face={plan.face}, loop={plan.loop}, "
              f"pairs={plan.pairs}, collate={plan.collate}"
              + (f", lag runs >= {plan.lag_min_s:g} s (async for)" if plan.lag else "")
              + (f", aioloader worker_nice={nice}" if nice else "")
              + (" (its default)" if nice and plan.worker_nice is None else "")
              + (f", peers: {', '.join(peers)}" if args.peers else "")
              + (", aioloader on Ray workers (beside: on worker processes)"
                 if plan.worker_type == "ray" else "")
              + (f", consumer step: {plan.step_ms} ms" if plan.step_ms is not None else "")
              + (f" on {plan.step_threads} thread(s)" if plan.step_threads else "")
              + (f", batches/epoch: {per_epoch}" if per_epoch else ""))
    try:
        machine = isolated(Spec(kind="refs", loop=plan.loop), plan.timeout)
    except MeasurementError as exc:
        print(f"aioloader bench: {exc}", file=sys.stderr)
        return 1
    print(machine_lines(machine, header), flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)

    failed = False
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    throughput = [w for w in workloads if w not in SPECIAL]
    for workload in throughput:
        t0 = time.monotonic()
        try:
            runs = run_workload(plan, workload)
        except MeasurementError as exc:
            print(f"aioloader bench: {workload}: {exc}", file=sys.stderr)
            raw[workload] = {"error": str(exc)}
            failed = True
            continue
        summary = summarise(workload, runs)
        rows.extend(summary)
        raw[workload] = {"runs": runs, "summary": [r.as_json() for r in summary]}
        _warn_leftovers(workload, runs)
        print(f"  ({workload}: {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

    found: list[Target] = []
    if throughput:
        print()
        print(table(rows))
        print()
        print(legend(rows))
        found = targets(rows, machine, plan.start_method)
        print()
        print(targets_header(QUICK_NOTE if args.quick else "medians over pairs"))
        print(target_lines(found, judged=not args.quick))
    if RESUME in args.workloads:
        raw[RESUME], resume_failed = _run_resume(args, pairs)
        failed |= resume_failed
    if REMOTE in args.workloads:
        raw[REMOTE], remote_failed = _remote.run_cli(args, pairs)
        failed |= remote_failed
    if FORMATS in args.workloads:
        raw[FORMATS], formats_failed = _formats.run_cli(args, pairs)
        failed |= formats_failed
    elapsed = time.monotonic() - started
    print(f"\n{len(rows)} rows in {elapsed:.1f} s" if throughput else f"\ndone in {elapsed:.1f} s")
    if args.json is not None:
        document = {
            "config": {"num_workers": plan.num_workers, "start_method": plan.start_method,
                       "pairs": plan.pairs, "batches": plan.batches, "face": plan.face,
                       "loop": plan.loop, "workloads": list(args.workloads),
                       "peers": list(plan.peers), "collate": plan.collate,
                       "lag": plan.lag, "lag_min_s": plan.lag_min_s,
                       "worker_nice": nice, "worker_type": plan.worker_type,
                       "step_ms": plan.step_ms, "step_threads": plan.step_threads},
            "machine": machine,
            "workloads": raw,
            # --quick judges nothing: its targets carry "passed": null
            "targets": [{**t.__dict__, "passed": None} if args.quick else t.__dict__
                        for t in found],
            "elapsed_s": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1, allow_nan=False, default=_nan_to_none)
            f.write("\n")
    return 1 if failed else 0


def _run_resume(args: argparse.Namespace, pairs: int) -> tuple[dict[str, Any], bool]:
    """The resume workload: its table printed; its JSON section and whether it failed."""
    items = args.resume_items or (_resume.QUICK_ITEMS if args.quick else _resume.DEFAULT_ITEMS)
    plan = ResumePlan(items=items, batch_size=args.resume_batch_size,
                      num_workers=args.num_workers, start_method=args.start_method,
                      positions=args.resume_positions, repeats=pairs,
                      timeout=float(args.timeout), state_from=args.resume_state)
    sides = list(_resume.SIDES)
    missing = _resume.torchdata_missing()
    if missing is not None:
        print(f"\nnote: {missing}", flush=True)
        sides.remove("torchdata")
    t0 = time.monotonic()
    config = {"items": plan.items, "batch_size": plan.batch_size,
              "positions": list(plan.positions), "batches": plan.targets(),
              "state_from": plan.state_from, "repeats": plan.repeats, "sides": sides}
    try:
        raw = _resume.run_resume(plan, sides, note=lambda line: print(
            f"  ({line})", file=sys.stderr, flush=True))
    except MeasurementError as exc:
        print(f"aioloader bench: {RESUME}: {exc}", file=sys.stderr)
        return {"config": config, "error": str(exc)}, True
    rows = _resume.summary_rows(plan, raw)
    print()
    print(_resume.table(plan, rows))
    for side, check in raw["checks"].items():
        verdict = "as from" if check["ok"] else "ELSEWHERE than from"
        print(f"check: {side} resumed from an edited state at batch {_resume.CHECK_AT} "
              f"{verdict} a consumed one")
    edited = sorted({how for how in raw["made_by"].values()})
    print(f"states made by: {', '.join(edited)}")
    for side, results in raw["runs"].items():
        _warn_leftovers(f"{RESUME}/{side}", {side: [r for rs in results.values() for r in rs]})
    print(f"  ({RESUME}: {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    bad_check = not all(c["ok"] for c in raw["checks"].values())
    return {"config": config, **raw, "summary": rows}, bad_check


def _nan_to_none(value: object) -> object:
    raise TypeError(f"not JSON-serialisable: {value!r}")


def _warn_leftovers(workload: str, runs: dict[str, list[Result]]) -> None:
    for side, results in runs.items():
        for r in results:
            if r.get("leftover_pids"):
                print(f"aioloader bench: warning: {workload}/{side} left processes "
                      f"{r['leftover_pids']} behind after closing its loader; killed them",
                      file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aioloader.bench [options]``, the same as ``aioloader bench``."""
    parser = argparse.ArgumentParser(prog="aioloader bench", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)


DESCRIPTION = (
    "Run aioloader and torch.utils.data.DataLoader on the same workloads (same num_workers, "
    "same start method, alternating runs, each in a fresh process) and print a side-by-side "
    "table and the targets aioloader is built to reach (--lag adds a ticker's lag on every "
    "workload; --workloads first-batch times a fresh loader to its first batch). The 'resume' "
    "workload (--workloads resume) compares resuming an epoch mid-way with torchdata's "
    "StatefulDataLoader instead.")
