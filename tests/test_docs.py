"""The code in README.md and docs/guide.md runs as written.

Each ```python block runs in a fresh interpreter, in a temporary directory of its own. A block
preceded by ``<!-- no-test -->`` is skipped: only for what truly cannot run here (a GPU).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "docs/guide.md", "docs/resume.md", "docs/loads.md", "docs/migrating.md"]
TIMEOUT = 120
BLOCK = re.compile(r"(?P<marker><!-- no-test -->\s*\n)?```python\n(?P<code>.*?)\n```", re.S)


def code_blocks() -> list[pytest.ParameterSet]:
    params = []
    for doc in DOCUMENTS:
        text = (ROOT / doc).read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            marks = [pytest.mark.skip(reason="marked no-test")] if match["marker"] else []
            params.append(pytest.param(match["code"], id=f"{doc}:{line}", marks=marks))
    return params


def test_documents_have_code() -> None:
    assert len(code_blocks()) >= 10


@pytest.mark.parametrize("code", code_blocks())
def test_block_runs(code: str, tmp_path: pathlib.Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code + "\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          start_new_session=True)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
