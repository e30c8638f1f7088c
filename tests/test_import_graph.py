"""The package's modules import one another without a circle: every import, at the top of a module or inside a
function, points down a graph with no cycle (a lazy import in a circle still ties two rooms together)."""

from __future__ import annotations

import ast
from pathlib import Path

import strata

SRC = Path(strata.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = ("strata", *path.relative_to(SRC).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement loads: `from p import m` loads p.m where m is a module, else p."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = imported(node, package)
            if isinstance(node, ast.ImportFrom) and all(target in modules for target in names[:-1]):
                names = names[:-1]  # `from package import module, ...`: the modules, not the package's body
            for target in names:
                while target and target not in modules:
                    target = target.rpartition(".")[0]  # a name inside a module: the module
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "strata.service" in graph["strata.api.app"]
    assert "strata.scheduling.batcher" in graph["strata.service"]
    assert len(graph) > 60


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert cycles(import_graph()) == []
