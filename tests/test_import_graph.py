"""dask_shm's modules import each other without circles.

The graph is read from the source with ``ast``: every ``import`` and ``from
... import`` naming a dask_shm module, function-local and ``TYPE_CHECKING``
ones included (a local import only hides a circle). ``from pkg import name``
is an arrow to ``pkg.name`` when that is a module, else to ``pkg`` (its
``__init__``). The compiled ``_core`` is a module with no arrows out."""

from __future__ import annotations

import ast
from pathlib import Path

import dask_shm

PACKAGE = Path(dask_shm.__file__).parent

#: Circles allowed: none.
KNOWN: list[set[str]] = []


def module_names() -> dict[str, Path | None]:
    """Dotted module name -> source file (None: compiled or stub only)."""
    names: dict[str, Path | None] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".so", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = [PACKAGE.name, *path.relative_to(PACKAGE).parts]
        parts[-1] = parts[-1].split(".")[0]
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if path.suffix == ".py":
            names[name] = path
        else:
            names.setdefault(name, None)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = module_names()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for target in targets:
                if target.split(".")[0] != PACKAGE.name:
                    continue
                resolved = known(target)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_local_and_relative_imports() -> None:
    graph = import_graph()
    assert "dask_shm._core" in graph and not graph["dask_shm._core"]
    # a top-level import, and one made inside a function (preload's, of the AMM)
    assert "dask_shm.liveness" in graph["dask_shm.shared.paths"]
    assert "dask_shm.amm" in graph["dask_shm.preload"]


def test_no_import_circles() -> None:
    found = [c for c in circles(import_graph()) if c not in KNOWN]
    assert found == [], "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]
