"""Exact mid-epoch resume through a real client: Lightning's ``Trainer.fit(ckpt_path=...)``.

tests/scripts_resume/lightning_fit.py runs, per loader configuration, an uninterrupted fit
of 2 epochs, a fit interrupted after step 18 (mid epoch 1) that checkpointed every 6 steps,
at the last batch of epoch 0 and at the end of epoch 0 (on_train_epoch_end), and fits
resumed from four of those checkpoints, each run in a fresh process. Lightning saves
``loader.state_dict()`` into the checkpoint (the fit loop's ``combined_loader``) when the
train loader has ``state_dict``/``load_state_dict``, and when it resumes an unfinished
epoch calls ``load_state_dict`` on the new run's loader before its first ``iter()``.

The steps seen before the checkpoint plus the steps of the resumed run must be the
uninterrupted run's, batch for batch. torchdata's StatefulDataLoader runs the same scenario
as a check of the harness; where it falls short, the test says so (strict xfail).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("lightning") is None:  # not importorskip: its import takes seconds
    pytest.skip("lightning is not installed", allow_module_level=True)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="forks, and reads /proc for leftovers")

sys.path.insert(0, str(Path(__file__).parent / "scripts_resume"))
from resume_harness import Expired, run_python  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts_resume" / "lightning_fit.py"
HARD_TIMEOUT = 300.0

CONFIGS = [("aioloader", 0), ("aioloader", 2), ("torchdata", 0), ("torchdata", 2)]
HAS_TORCHDATA = importlib.util.find_spec("torchdata") is not None

# torchdata 0.11, reproduced without Lightning: with num_workers=0 a loader resumed in epoch 0
# shuffles epoch 1 differently from the uninterrupted run (num_workers=2 does not).
TORCHDATA_EARLY = "torchdata 0.11, num_workers=0: the epoch after a resumed one is reshuffled"
# After the last batch of an epoch its state says "this epoch is done, the loop has not
# ended": the first iter() after load_state_dict is empty. Lightning has moved on to the
# next epoch by then, so that epoch is lost (meta-pytorch/data#1437, verl-project/verl#7401).
TORCHDATA_BOUNDARY = "torchdata: a state taken after an epoch's last batch resumes empty"
# Lightning restores no loader state from an end-of-epoch checkpoint, and StatefulDataLoader
# has no sampler with set_epoch(): the fresh loader replays epoch 0's shuffle as epoch 1.
TORCHDATA_EPOCH_END = "torchdata: no set_epoch() for Lightning, so epoch 1 replays epoch 0"


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every configuration's runs, from one script (Lightning's import takes seconds) that
    forks each run; a session of its own, nothing of which may outlive it."""
    configs = [f"{k}:{w}" for k, w in CONFIGS if k != "torchdata" or HAS_TORCHDATA]
    workdir = tmp_path_factory.mktemp("lightning")
    args = [str(SCRIPT), "scenario", "--workdir", str(workdir)]
    for config in configs:
        args += ["--config", config]
    try:
        done = run_python(args, HARD_TIMEOUT)
    except Expired as exc:
        pytest.fail(f"the scenario {exc}")
    return {"workdir": workdir, "output": done.stdout, "returncode": done.returncode}


@pytest.fixture(params=CONFIGS, ids=[f"{k}-w{w}" for k, w in CONFIGS])
def scenario(request: pytest.FixtureRequest, scenarios: dict[str, Any]) -> dict[str, Any]:
    loader, num_workers = request.param
    if loader == "torchdata" and not HAS_TORCHDATA:
        pytest.skip("torchdata is not installed")
    workdir = scenarios["workdir"] / f"{loader}-w{num_workers}"
    path = workdir / "summary.json"
    assert path.exists(), (
        f"no summary for {loader}:{num_workers} (exit {scenarios['returncode']}):\n"
        f"{scenarios['output'][-4000:]}")
    summary: dict[str, Any] = json.loads(path.read_text())
    summary.update(loader=loader, num_workers=num_workers, workdir=workdir,
                   output=scenarios["output"])
    return summary


def steps(scenario: dict[str, Any], run: str) -> list[tuple[int, int, list[int]]]:
    """(epoch, batch_idx, indices) of every training step of ``run``; fails if it failed."""
    result = scenario["runs"][run]
    assert result.get("status") == "ok", (
        f"run {run!r}: {result.get('status') or result.get('skipped')}\n"
        f"{result.get('error', '')}\n{scenario['output'][-3000:]}")
    log = scenario["workdir"] / f"{run}.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [(r["epoch"], r["batch_idx"], r["i"]) for r in map(json.loads, lines)]


def expect_failure(request: pytest.FixtureRequest, scenario: dict[str, Any],
                   when: dict[tuple[str, int], str]) -> None:
    reason = when.get((scenario["loader"], scenario["num_workers"]))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))


def _diff(got: list[Any], want: list[Any]) -> str:
    for k, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"first difference at step {k}: got {g}, uninterrupted run had {w}"
    return f"{len(got)} steps instead of {len(want)}"


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_uninterrupted_run_sees_every_index_once_per_epoch(scenario: dict[str, Any]) -> None:
    full = steps(scenario, "full")
    per_epoch = scenario["batches_per_epoch"]
    assert len(full) == 2 * per_epoch
    for epoch in range(2):
        seen = [i for e, _, batch in full if e == epoch for i in batch]
        assert sorted(seen) == list(range(100)), f"epoch {epoch}"
    first, second = ([i for e, _, b in full if e == k for i in b] for k in range(2))
    assert first != second, "epoch 1 was not reshuffled"


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_resume_mid_epoch_continues_the_uninterrupted_run(scenario: dict[str, Any]) -> None:
    full, interrupted = steps(scenario, "full"), steps(scenario, "interrupted")
    resumed = steps(scenario, "resume_mid")
    stop, per_epoch = scenario["stop_at"], scenario["batches_per_epoch"]
    assert len(interrupted) == stop
    assert resumed, "the resumed run trained no step"
    assert resumed[0][:2] == (stop // per_epoch, stop % per_epoch), (
        f"the resumed run started at (epoch, batch_idx) {resumed[0][:2]}, not mid-epoch "
        f"where the checkpoint was taken: {(stop // per_epoch, stop % per_epoch)}")
    assert resumed[0][2] != full[(stop // per_epoch) * per_epoch][2], (
        "the resumed run repeated its epoch from the start")
    assert interrupted + resumed == full, _diff(interrupted + resumed, full)


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_resume_from_an_earlier_checkpoint(request: pytest.FixtureRequest,
                                           scenario: dict[str, Any]) -> None:
    """From step 6 (epoch 0) while the interrupted run went on to step 18: later batches
    did not change what was saved, and the next epoch's shuffle is the same."""
    expect_failure(request, scenario, {("torchdata", 0): TORCHDATA_EARLY})
    full, interrupted = steps(scenario, "full"), steps(scenario, "interrupted")
    resumed = steps(scenario, "resume_early")
    every = scenario["every"]
    assert resumed[:1] == full[every:every + 1]
    assert interrupted[:every] + resumed == full, _diff(interrupted[:every] + resumed, full)


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_resume_from_the_last_batch_of_an_epoch(request: pytest.FixtureRequest,
                                                scenario: dict[str, Any]) -> None:
    """The checkpoint taken at the last batch of epoch 0 (on_train_batch_end): Lightning
    resumes at epoch 1, batch 0, and calls iter() on the loader once for it."""
    expect_failure(request, scenario, {("torchdata", 0): TORCHDATA_BOUNDARY,
                                       ("torchdata", 2): TORCHDATA_BOUNDARY})
    full, interrupted = steps(scenario, "full"), steps(scenario, "interrupted")
    resumed = steps(scenario, "resume_epoch")
    per_epoch = scenario["batches_per_epoch"]
    assert resumed, (
        "resumed from the checkpoint at the last batch of epoch 0, Lightning trained no step: "
        "it moved on to epoch 1 and the loader's first epoch after load_state_dict was empty, "
        "so epoch 1 was lost")
    assert interrupted[:per_epoch] + resumed == full, (
        _diff(interrupted[:per_epoch] + resumed, full))


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_resume_from_an_end_of_epoch_checkpoint(request: pytest.FixtureRequest,
                                                scenario: dict[str, Any]) -> None:
    """The checkpoint of on_train_epoch_end (Lightning's default ModelCheckpoint when there
    is no validation): the epoch is complete, so Lightning does not call load_state_dict at
    all; it calls ``sampler.set_epoch(1)`` on the loader's ``sampler`` or
    ``batch_sampler.sampler`` if it has one, then iter(). Epoch 1 must still be epoch 1."""
    expect_failure(request, scenario, {("torchdata", 0): TORCHDATA_EPOCH_END,
                                       ("torchdata", 2): TORCHDATA_EPOCH_END})
    full, interrupted = steps(scenario, "full"), steps(scenario, "interrupted")
    resumed = steps(scenario, "resume_epoch_end")
    per_epoch = scenario["batches_per_epoch"]
    assert resumed[:1] == full[per_epoch:per_epoch + 1], (
        "resumed from the end-of-epoch checkpoint, epoch 1 did not start as in the "
        f"uninterrupted run: got {resumed[:1]}, expected {full[per_epoch:per_epoch + 1]}")
    assert interrupted[:per_epoch] + resumed == full, (
        _diff(interrupted[:per_epoch] + resumed, full))


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_checkpoints_hold_the_loader_state(scenario: dict[str, Any]) -> None:
    steps(scenario, "interrupted")
    workdir = scenario["workdir"]
    states = []
    for name in (f"mid/step={scenario['every']}.ckpt", f"mid/step={scenario['stop_at']}.ckpt",
                 f"boundary/step={scenario['batches_per_epoch']}.ckpt"):
        checkpoint = torch.load(workdir / name, map_location="cpu", weights_only=False)
        fit_loop = checkpoint["loops"]["fit_loop"]["state_dict"]
        assert "combined_loader" in fit_loop, (
            f"{name}: Lightning saved no loader state (it saves it only for a train loader "
            "with state_dict() and load_state_dict())")
        (state,) = fit_loop["combined_loader"]
        assert isinstance(state, dict) and state
        if scenario["loader"] == "aioloader":
            assert json.loads(json.dumps(state)) == state, f"{name}: not JSON-able: {state}"
        states.append(repr(state))
    assert len(set(states)) == len(states), "two checkpoints hold the same loader state"


@pytest.mark.deadline(HARD_TIMEOUT + 60)
def test_no_run_leaves_processes_behind(scenario: dict[str, Any]) -> None:
    """Lightning never closes the loader: the run's end (the garbage collector) must."""
    left = {name: run["leftover_pids"] for name, run in scenario["runs"].items()
            if run.get("leftover_pids")}
    assert not left, f"processes still there 10 s after the fit returned: {left}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightnings_access_pattern_reshuffles_every_epoch(num_workers: int) -> None:
    """Lightning knows len(loader): it calls next() that many times, never to StopIteration,
    then iter() again for the next epoch, as torch's DataLoader allows. That must be the
    next epoch (reshuffled), the same one a `for` loop over the loader gets."""
    import aioloader

    def loader() -> aioloader.DataLoader:
        return aioloader.DataLoader(list(range(100)), batch_size=8, shuffle=True, seed=1234,
                                    num_workers=num_workers, quiet=True)

    bounded, looped = loader(), loader()
    try:
        n = len(bounded)
        by_len = []
        for _ in range(2):
            it = iter(bounded)
            by_len.append([next(it).tolist() for _ in range(n)])
        del it
        by_loop = [[b.tolist() for b in looped] for _ in range(2)]
    finally:
        bounded.close()
        looped.close()
    assert by_loop[0] != by_loop[1], "a for loop's epochs are not reshuffled"
    assert by_len[0] == by_loop[0]
    assert by_len[1] != by_len[0], (
        "iter() after len(loader) batches repeated the epoch: its shuffle did not move on")
    assert by_len == by_loop
