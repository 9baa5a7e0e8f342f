"""The house, drawn from its imports: three layers, roles inside collectives, no cycle.

Every import of every module of the three packages counts, also the ones
inside functions. ``python tests/test_architecture.py`` prints the drawing
that ``docs/architecture.rst`` shows.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("collectives", "algorithms", "mpidl")  # bottom to top: a package imports only those before it

#: The parts of collectives, bottom to top: a part imports only its own modules and the parts before it.
COLLECTIVES_PARTS = (
    "collectives.errors",
    "collectives.transport",
    "collectives.topology",
    "collectives.kernels",
    "collectives.validation",
    "collectives.tuning",
    "collectives.api",
    "collectives.gather",
    "collectives.nonblocking",
    "collectives.partial",
    "collectives.compression",
    "collectives",  # the package's face: re-exports
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the three packages by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known or (t.split(".")[0] in PACKAGES and t in known))
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def part_of(module: str) -> str:
    """The collectives part (of :data:`COLLECTIVES_PARTS`) that ``module`` belongs to."""
    return max((p for p in COLLECTIVES_PARTS if module == p or module.startswith(p + ".")), key=len)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_packages_import_only_downward() -> None:
    rank = {pkg: i for i, pkg in enumerate(PACKAGES)}
    upward = [
        (a, b) for a, targets in graph().items() for b in targets if rank[b.split(".")[0]] > rank[a.split(".")[0]]
    ]
    assert upward == []


def test_collectives_parts_import_only_downward() -> None:
    rank = {part: i for i, part in enumerate(COLLECTIVES_PARTS)}
    g = graph()
    upward = [
        (a, b)
        for a, targets in g.items()
        if a.startswith("collectives")
        for b in targets
        if rank[part_of(b)] > rank[part_of(a)]
    ]
    assert upward == []


def test_every_package_says_its_role() -> None:
    for name, path in modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and doc.splitlines()[0].strip(), f"{name} has no one-line docstring"


@pytest.mark.parametrize("part", [p for p in COLLECTIVES_PARTS if p != "collectives"])
def test_parts_exist(part: str) -> None:
    assert part in modules(), f"{part} is drawn but does not exist"


def drawing() -> str:
    """The layers and parts, bottom last, each with what it imports (parts, not modules)."""
    g = graph()
    edges: dict[str, set[str]] = defaultdict(set)
    for a, targets in g.items():
        for b in targets:
            pa = part_of(a) if a.startswith("collectives") else a.split(".")[0]
            pb = part_of(b) if b.startswith("collectives") else b.split(".")[0]
            if pa != pb:
                edges[pa].add(pb)
    rows = [*PACKAGES[:0:-1], *COLLECTIVES_PARTS[::-1]]
    width = max(map(len, rows))
    return "\n".join(
        f"{row:<{width}}  -> {', '.join(sorted(edges[row])) or '(nothing of the project)'}" for row in rows
    )


if __name__ == "__main__":
    print(drawing())
