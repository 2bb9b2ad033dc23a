"""The spans package has no import circles: the modules of dask_shm.spans form a
DAG (runtime, TYPE_CHECKING and function-local imports all count), and the wire
names live in dask_shm.spans.protocol, which imports none of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import dask_shm.spans
from dask_shm.spans import protocol

PACKAGE = "dask_shm.spans"


def spans_import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in Path(dask_shm.spans.__file__).parent.glob("*.py"):
        module = PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            # the package itself is the parent of every module, not a dependency
            deps.update(n for n in names if n.startswith(PACKAGE + "."))
        graph[module] = deps - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for dep in sorted(graph.get(node, ())):
            cycle = visit(dep, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_spans_modules_have_no_import_circle():
    graph = spans_import_graph()
    assert f"{PACKAGE}.worker" in graph and f"{PACKAGE}.scheduler" in graph
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_wire_names_live_in_protocol_and_are_what_the_extensions_use():
    assert spans_import_graph()[f"{PACKAGE}.protocol"] == set()
    worker = importlib.import_module(f"{PACKAGE}.worker")
    scheduler = importlib.import_module(f"{PACKAGE}.scheduler")
    client = importlib.import_module(f"{PACKAGE}.client")
    assert worker.METRIC_NAME is scheduler.METRIC_NAME is protocol.METRIC_NAME
    assert worker.HINTS_OP is scheduler.HINTS_OP is protocol.HINTS_OP
    assert client.RPC_NAME is scheduler.RPC_NAME is protocol.RPC_NAME
    # wire values unchanged: workers and schedulers of other versions interoperate
    assert (protocol.METRIC_NAME, protocol.HINTS_OP, protocol.RPC_NAME) == (
        "dask_shm_span_memory",
        "dask_shm_span_hints",
        "dask_shm_span_memory",
    )
    assert protocol.as_key(["a", [1, 2]]) == ("a", (1, 2))
