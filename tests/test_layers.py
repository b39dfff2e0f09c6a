"""The package's import graph: no cycle, no private name imported from another module, and
the layers of docs/architecture.md in order (a module never imports one above it).

A module is named by its dotted path under ``aioloader`` (``run._run``); a layer is a
subpackage (``run``, ``workers``, ...) or a top-level module.
"""

from __future__ import annotations

import ast
import pathlib

import aioloader

PACKAGE = pathlib.Path(aioloader.__file__).parent

# Top to bottom: a module may import only modules of its own layer or of later ones.
LAYERS = [
    ["__init__", "__main__", "bench", "testing"],  # the public face and the tools
    ["_loader"],
    ["_signature"],
    ["readers"],  # ready-made readers: users' code, on the pipeline's load stage
    ["run"],  # the run and its faces
    ["workers"],  # workers and their transports
    ["_config", "_options"],  # the frozen config: data every layer above reads
    ["pipeline"],  # source -> loads -> batcher -> collate
    ["plans"],  # pure: plans, samplers, positions, state, reshaping, sources
    ["plane"],  # how a batch travels: arena, slots, codec, wire, device hand-off
    ["_errors", "_info", "_stats", "_loops", "_servers"],  # leaves
]

# Inside a layer's package, the same rule between its modules (unlisted ones: unranked).
INSIDE = {
    "run": [["_sync", "_epoch"], ["_run"], ["_setup", "_checkpoint", "_owned", "_reading"],
            ["_padding", "_session", "_phase", "_portal"], ["_backstop", "_bars"]],
    "workers": [["_producers", "_local"], ["_supervisor", "_ray"],
                ["_link", "_standby", "_ray_cluster", "_threads"],
                ["_supervising", "_phases", "_starting", "_pickling"],
                ["_worker", "_ray_actor", "_steps"], ["_channel", "_passes"],
                ["_spec", "_failures"]],
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    path = PACKAGE.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for each import of a module of the package, outside
    TYPE_CHECKING; ``from ..plane import _wire`` is an import of the module ``plane._wire``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = list(path.relative_to(PACKAGE).parent.parts)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package[: len(package) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
        names = [alias.name for alias in node.names]
        modules = [n for n in names if _is_module(f"{target}.{n}" if target else n)]
        for name in modules:
            found.append((f"{target}.{name}" if target else name, []))
        rest = [n for n in names if n not in modules]
        if rest:
            found.append((target or "__init__", rest))
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


def _rank(table: list[list[str]], name: str) -> int | None:
    return next((i for i, layer in enumerate(table) if name in layer), None)


def test_every_module_has_a_layer() -> None:
    assert not [m for m in graph() if _rank(LAYERS, m.split(".")[0]) is None]
    unplaced = [m for m in graph() if m.count(".") == 1 and m.split(".")[0] in INSIDE
                and _rank(INSIDE[m.split(".")[0]], m.split(".")[1]) is None]
    assert not unplaced, f"place these in INSIDE: {unplaced}"


def test_layers_import_downwards_only() -> None:
    upward = []
    for m, deps in graph().items():
        here = m.split(".")
        for t, _ in deps:
            there = t.split(".")
            if here[0] != there[0]:
                a, b = _rank(LAYERS, here[0]), _rank(LAYERS, there[0])
            elif here[0] in INSIDE and len(here) > 1 and len(there) > 1:
                a, b = _rank(INSIDE[here[0]], here[1]), _rank(INSIDE[here[0]], there[1])
            else:
                continue
            if a is not None and b is not None and b < a:
                upward.append(f"{m} imports {t}")
    assert not upward, upward


def test_each_layer_says_what_it_must_not_know() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Must not know" in doc or init.parent.name in ("bench", "readers"), init
