"""The package's import graph: no cycle, no private name imported from another module, and
the layers of docs/architecture.md in order (a module never imports one above it)."""

from __future__ import annotations

import ast
import pathlib

import aioloader

PACKAGE = pathlib.Path(aioloader.__file__).parent

# Top to bottom: each module may import only modules of later layers (or its own).
LAYERS = [
    ["__init__"],
    ["_loader"],
    ["_sync", "_epoch"],
    ["_run"],
    ["_setup"],
    ["_producers", "_local"],
    ["_supervisor", "_ray"],
    ["_phases", "_starting", "_threads"],
    ["_worker", "_ray_actor"],
]


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts)


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for each import of a sibling module, outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    here = module_name(path).split(".")
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = here[: len(here) - node.level]
        if path.name == "__init__.py":
            base = here[: len(here) - node.level + 1]
        target = ".".join([*base, node.module] if node.module else base)
        names = [alias.name for alias in node.names]
        if node.module is None:  # from . import _wire
            for name in names:
                found.append((".".join([*base, name]), []))
        else:
            found.append((target, names))
    return found


def graph() -> dict[str, list[tuple[str, list[str]]]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_import_cycle() -> None:
    edges = {m: sorted({t for t, _ in deps if t != m}) for m, deps in graph().items()}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(m):], m]))
        if m in done:
            return
        for t in edges.get(m, []):
            visit(t, [*stack, m])
        done.add(m)

    for m in edges:
        visit(m, [])


def test_no_private_name_is_imported_from_another_module() -> None:
    bad = [f"{m} imports {name} from {t}"
           for m, deps in graph().items() for t, names in deps
           for name in names if name.startswith("_") and not name.startswith("__")]
    assert not bad, bad


def test_layers_import_downwards_only() -> None:
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = []
    for m, deps in graph().items():
        if m not in rank:
            continue
        for t, _ in deps:
            if t in rank and rank[t] < rank[m]:
                upward.append(f"{m} imports {t}")
    assert not upward, upward
