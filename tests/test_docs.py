"""The code in README.md and the docs pages runs as written.

Each ```python block runs in a fresh interpreter, in a temporary directory of its own. A block
preceded by ``<!-- no-test -->`` is skipped: only for what truly cannot run here (a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "docs/guide.md", "docs/resume.md", "docs/loads.md", "docs/migrating.md",
             "docs/beyond.md", "docs/webdataset.md", "docs/parquet.md"]
TIMEOUT = 120
BLOCK = re.compile(r"(?P<marker><!-- no-test -->\s*\n)?```python\n(?P<code>.*?)\n```", re.S)


def code_blocks() -> list[pytest.ParameterSet]:
    params = []
    for doc in DOCUMENTS:
        text = (ROOT / doc).read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            marks = [pytest.mark.skip(reason="marked no-test")] if match["marker"] else []
            if "import ray" in match["code"] and importlib.util.find_spec("ray") is None:
                marks.append(pytest.mark.skip(reason="needs Ray: pip install -e '.[ray]'"))
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


def test_readme_lists_every_docs_page_and_example() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    missing = [f"docs/{p}" for p in pages if f"(docs/{p})" not in readme]
    missing += [f"examples/{e}" for e in examples if f"(examples/{e})" not in readme]
    assert not missing, f"README.md's documentation list leaves out {missing}"


def test_readme_opens_with_the_two_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1].strip().splitlines()
    assert len(first_block) == 2, first_block
    install, tests = first_block
    assert install.startswith("pip install torch==2.13.0 && ")
    assert "-c constraints.txt" in tests and tests.endswith("python -m pytest -n 2")


def test_constraints_pin_every_extra_requirement() -> None:
    """Each package an extra names has one exact version in constraints.txt (else an old pip
    may backtrack over it for minutes, issue 19)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    wanted = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        wanted += extra
    names = {re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!;~]", req, maxsplit=1)[0]).lower()
             for req in wanted}
    names.discard("torch")  # installed first, as the README says; the machine caps its version
    names.discard("aioloader")  # an extra naming another of ours: s3-local brings remote's
    assert sorted(names - pinned.keys()) == []
