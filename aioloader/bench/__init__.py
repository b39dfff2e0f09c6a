"""The ``aioloader bench`` command: aioloader against torch's DataLoader, side by side."""

from ._cli import DESCRIPTION, add_arguments, main, run

__all__ = ["DESCRIPTION", "add_arguments", "main", "run"]
