"""Fault-injection suite: this folder goes on sys.path so that spawned workers can import
``victims``; the deadline and the leak check come from tests/conftest.py."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
