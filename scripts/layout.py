"""The runtime core's size and import graph at a git revision (issue 34's before and after).

``python scripts/layout.py [REV ...]`` (default: HEAD) prints, for each revision, the runtime
core's lines (``aioloader/`` without ``bench/``, ``readers/``, ``testing.py`` and
``_servers.py``: the count issue 34 sets a goal for), its modules, those over 500 lines, the
lines of each layer, and the imports between modules of the core: in all, and from one
layer to another. The tree is read from git (``git archive``), never from the working copy.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import pathlib
import subprocess
import sys
import tarfile

OUTSIDE = ("bench", "readers", "testing", "_servers")  # not the runtime core
LIMIT = 500


def files_at(rev: str) -> dict[str, tuple[str, bool]]:
    """``aioloader/``'s Python files at ``rev`` by dotted module name: (source, whether it is
    a package's ``__init__``)."""
    tar = subprocess.run(["git", "archive", rev, "aioloader"], check=True,
                         capture_output=True).stdout
    modules = {}
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            path = pathlib.PurePosixPath(member.name)
            if member.isfile() and path.suffix == ".py":
                parts = list(path.with_suffix("").parts[1:])
                init = parts[-1] == "__init__"
                if init and len(parts) > 1:
                    parts.pop()
                extracted = archive.extractfile(member)
                assert extracted is not None
                modules[".".join(parts)] = (extracted.read().decode(), init)
    return modules


def imported(name: str, source: str, init: bool, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports (relative imports, ``from . import _x`` too)."""
    here = ([] if name == "__init__" else name.split(".")) if init else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1] if node.level > 1 else here
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                child = f"{target}.{alias.name}".strip(".")
                found.add(child if child in known else target)
    return {m for m in found if m in known and m != name}


def layer(name: str, modules: dict[str, str]) -> str:
    """A module's layer: its subpackage, or ``(top)`` for a top-level module."""
    top = name.split(".")[0]
    return top if "." in name or any(m.startswith(f"{top}.") for m in modules) else "(top)"


def report(rev: str) -> None:
    """Print the core's sizes and import graph at ``rev``."""
    files = {n: f for n, f in files_at(rev).items() if n.split(".")[0] not in OUTSIDE}
    modules = {n: source for n, (source, _) in files.items()}
    sizes = {n: len(s.splitlines()) for n, s in modules.items()}
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])
    per_layer: collections.Counter[str] = collections.Counter()
    for n, size in sizes.items():
        per_layer[layer(n, modules)] += size
    edges = {n: imported(n, s, init, set(modules)) for n, (s, init) in files.items()}
    across: collections.Counter[tuple[str, str]] = collections.Counter(
        (layer(a, modules), layer(b, modules)) for a, targets in edges.items() for b in targets
        if layer(a, modules) != layer(b, modules))
    print(f"{rev}: runtime core {sum(sizes.values())} lines in {len(modules)} modules")
    print(f"  over {LIMIT} lines: {[n for n, s in largest if s > LIMIT] or 'none'}")
    print("  largest: " + ", ".join(f"{n} {s}" for n, s in largest[:6]))
    print("  per layer: " + ", ".join(f"{k} {v}" for k, v in per_layer.most_common()))
    print(f"  imports between core modules: {sum(map(len, edges.values()))}; "
          f"between layers ({sum(across.values())}): "
          + ", ".join(f"{a}->{b} {c}" for (a, b), c in sorted(across.items())))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", default=["HEAD"])
    for rev in parser.parse_args(argv).revs:
        report(rev)


if __name__ == "__main__":
    main(sys.argv[1:])
