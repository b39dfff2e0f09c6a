"""worker_type="ray"'s arguments, checked at construction; these need no Ray (the second is
about a machine without it), so they live apart from tests/test_ray.py, which skips there."""

from __future__ import annotations

import pytest
from ray_sources import Items

import aioloader


def test_argument_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="ray_options applies to worker_type='ray'"):
        aioloader.DataLoader(Items(4), batch_size=2, ray_options={"num_cpus": 1})
    with pytest.raises(ValueError, match=r"max_restarts.*max_worker_restarts"):
        aioloader.DataLoader(Items(4), batch_size=2, worker_type="ray", num_workers=1,
                             ray_options={"max_restarts": 3})
    with pytest.raises(TypeError, match="ray_options must be a dict"):
        aioloader.DataLoader(Items(4), batch_size=2, worker_type="ray", num_workers=1,
                             ray_options=[("num_cpus", 1)])


def test_without_ray_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ray\]' in a clone of aioloader"):
        aioloader.DataLoader(Items(4), batch_size=2, worker_type="ray", num_workers=1)
