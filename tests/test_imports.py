"""The package's imports form a tree: no module of ``distlab`` imports itself back, however far.

Every import statement counts, at module level or inside a function (a cycle through a lazy
import is still a cycle of responsibilities), except those under ``if TYPE_CHECKING:``, which
never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import distlab

PACKAGE = Path(distlab.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The distlab modules ``path`` imports (``from a import b`` counts ``a.b`` when it is a module,
    and every package above an imported module: its ``__init__`` runs first)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_blocks(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    found |= {
        m.rsplit(".", k)[0] for m in found for k in range(1, m.count(".") + 1)
    }  # packages' __init__ run first
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    for name in graph:  # importing a.b.c runs a/__init__ and a/b/__init__ first: edges that cannot cycle
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == 1:
                return path[path.index(nxt) :] + [nxt]
            if colour[nxt] == 0 and (cycle := visit(nxt)):
                return cycle
        path.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (cycle := visit(node)):
            return cycle
    return None


def test_distlab_has_no_import_cycle() -> None:
    graph = import_graph()
    assert (
        "distlab.gpt.training.training" in graph and graph["distlab.gpt.training.training"]
    )  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
