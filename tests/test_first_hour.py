"""What a newcomer meets in the first hour (issue 36): errors that say what went wrong and
what to do, under the public names that tracebacks show."""

from __future__ import annotations

import os
import pathlib
import pickle
import sys
import textwrap
import tomllib
import traceback

import pytest
import torch
from test_examples import run_script

import aioloader
import aioloader.testing
from aioloader import _servers

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT_DEADLINE = 120  # seconds for a script run in a subprocess, spawn's imports included


class GapDataset(torch.utils.data.Dataset[dict[str, int]]):
    """Index 5's sample has no "x"."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"x": i, "y": i} if i != 5 else {"y": i}


class BadSample(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 2:
            raise ValueError("bad sample 2")
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_without_a_key_is_named_through_the_loader(num_workers: int) -> None:
    loader = aioloader.DataLoader(GapDataset(), batch_size=4, num_workers=num_workers,
                                  quiet=True)
    with loader, pytest.raises(KeyError) as info:  # also a KeyError, as torch's is
        list(loader)
    err = info.value
    assert isinstance(err, aioloader.CollateKeyError)
    expected = ("sample 1 of the batch (index 5) has no key 'x' at the top level, which the "
                "first sample has: the first sample's keys are ['x', 'y'], this one's ['y']")
    assert expected in str(err), str(err)
    if num_workers:
        assert isinstance(err, aioloader.WorkerError), type(err).__mro__
        assert isinstance(err.__cause__, aioloader.CollateKeyError)
        assert err.__cause__.sample == 5 and err.__cause__.position == 1


def test_every_public_error_class_is_named_by_its_public_path() -> None:
    errors = [getattr(aioloader, name) for name in aioloader.__all__
              if isinstance(getattr(aioloader, name), type)
              and issubclass(getattr(aioloader, name), BaseException)]
    assert aioloader.ArgumentTypeError in errors and aioloader.CollateKeyError in errors
    for cls in errors:
        assert cls.__module__ == "aioloader", cls
        assert pickle.loads(pickle.dumps(cls)) is cls  # found where it says it lives
    assert aioloader.testing.ServerStartError.__module__ == "aioloader.testing"


def test_an_argument_of_the_wrong_type_shows_its_public_name() -> None:
    with pytest.raises(aioloader.ArgumentTypeError) as info:
        aioloader.DataLoader([1, 2], batch_size="8")
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    last = traceback.format_exception(info.value)[-1]
    assert last.startswith("aioloader.ArgumentTypeError: batch_size must be"), last


def test_a_workers_exception_class_resolves_where_its_traceback_names_it() -> None:
    loader = aioloader.DataLoader(BadSample(), batch_size=2, num_workers=1, quiet=True)
    with loader, pytest.raises(ValueError) as info:
        list(loader)
    cls = type(info.value)
    assert f"{cls.__module__}.{cls.__name__}" == "aioloader.ValueErrorFromWorker"
    assert aioloader.ValueErrorFromWorker is cls
    assert issubclass(cls, aioloader.WorkerError)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        aioloader.NoSuchThing  # noqa: B018


def test_a_missing_server_module_names_the_extra_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = _servers.importlib.util.find_spec

    def without_moto(name: str, package: str | None = None) -> object:
        return None if name == "moto" else real(name, package)

    monkeypatch.setattr(_servers.importlib.util, "find_spec", without_moto)
    with pytest.raises(aioloader.testing.ServerStartError) as info, \
            aioloader.testing.s3_server():
        pass
    assert str(info.value) == ("the s3 server needs moto, which is not installed: in a clone "
                               'of aioloader, pip install -e ".[s3-local]" -c constraints.txt')


def test_each_servers_extra_brings_what_it_needs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    brought = {name: " ".join(extras[name]) for name in extras}
    brought["s3-local"] += " " + brought["remote"]  # it names the remote extra
    for modules, extra in _servers.NEEDS.values():
        assert extra in extras, extra
        for module in modules:
            distribution = "moto[server]" if module == "werkzeug" else module
            assert distribution in brought[extra], (module, extra)


UNGUARDED = textwrap.dedent("""
    import aioloader

    class Squares(aioloader.Reader):
        def read(self, n):
            for i in range(n):
                yield {"x": i}

    # No `if __name__ == "__main__":` guard: spawn re-runs this in every worker.
    loader = aioloader.DataLoader(Squares(), 10, batch_size=2, num_workers=2,
                                  start_method="spawn", quiet=True)
    print(sum(len(b["x"]) for b in loader))
""")


@pytest.mark.deadline(SCRIPT_DEADLINE + 30)
def test_spawn_without_a_main_guard_says_so(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    returncode, err = run_script([sys.executable, str(script)], tmp_path, env,
                                 timeout=SCRIPT_DEADLINE)
    assert returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("aioloader.WorkerDied: worker "), err[-3000:]
    assert "died unexpectedly: exit code 87: it re-ran your script's top-level code" in last
    assert 'under `if __name__ == "__main__":`' in last
    # Each worker said so itself too, in place of multiprocessing's long RuntimeError.
    assert "aioloader: a worker process stopped while it started" in err
    assert "bootstrapping phase" not in err
