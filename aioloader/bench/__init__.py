"""The ``aioloader bench`` command: aioloader against torch's DataLoader, side by side.

The command's names load on first use: a spawned worker that unpickles one of the bench's
datasets (``aioloader.bench._workloads``) then imports that module alone, as it would a
user's dataset module, not the whole command (a few hundred ms per worker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cli import DESCRIPTION, add_arguments, main, run

__all__ = ["DESCRIPTION", "add_arguments", "main", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _cli

        return getattr(_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
