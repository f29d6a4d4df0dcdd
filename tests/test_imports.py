"""The package's imports form a tree: no module of ``distlab`` imports itself back, however far,
and no subpackage of it (``distlab.gpt``, ``distlab.logs``, ...) imports another that imports it back.

Every import statement counts, at module level or inside a function (a cycle through a lazy
import is still a cycle of responsibilities), except those under ``if TYPE_CHECKING:``, which
never run.

The GPT engine (``distlab.gpt``) is also held to its layout: root modules and subpackages in
layers (:data:`LAYERS`), each importing only its own layer and those below it; at most 7 modules
at its root, at least 5 subpackages, no module over 450 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import distlab

pytestmark = pytest.mark.engine_fast

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


def named_modules(source: str, package: str, *, type_checking: bool = False) -> set[str]:
    """The modules the import statements of ``source`` (a module of ``package``) name, in functions
    too: ``import a.b`` names ``a.b``, ``from a import b`` names ``a`` and ``a.b`` (relative imports
    resolved); those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    tree = ast.parse(source)
    skip = set() if type_checking else _type_checking_blocks(tree)
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
    return found


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The distlab modules ``path`` imports (``from a import b`` counts ``a.b`` when it is a module,
    and every package above an imported module: its ``__init__`` runs first)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = named_modules(path.read_text(), package)
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


# --- distlab's subpackages ----------------------------------------------------------------------

#: distlab's subpackages (gpt, logs, comm, cluster, profiling, cifar, ...), each a node of the
#: package-level graph; distlab's root modules (launch helpers, checks) are no node.
SUBPACKAGES = frozenset(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def package_graph(graph: dict[str, set[str]], subpackages: frozenset[str]) -> dict[str, set[str]]:
    """The module graph collapsed to ``distlab.<subpackage>`` nodes: an edge wherever a module of
    one subpackage imports a module of another; modules outside every subpackage left out."""

    def node(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in subpackages else None

    packages: dict[str, set[str]] = {f"distlab.{name}": set() for name in subpackages}
    for module, imported in graph.items():
        here = node(module)
        if here is not None:
            packages[here] |= {there for m in imported if (there := node(m)) not in (None, here)}
    return packages


def test_distlab_subpackages_import_each_other_without_a_cycle() -> None:
    """The engine prints, the readers read: ``distlab.logs`` imports ``distlab.gpt`` (the log
    lines live with their printers), never the reverse; no two subpackages import each other."""
    packages = package_graph(import_graph(), SUBPACKAGES)
    assert {"distlab.gpt", "distlab.logs", "distlab.comm"} <= packages.keys()
    assert "distlab.gpt" in packages["distlab.logs"]  # the walk sees the readers' imports
    cycle = find_cycle(packages)
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


def test_the_package_graph_names_a_cycle_between_subpackages() -> None:
    graph = {
        "distlab.logs.megatron": {"distlab.gpt.build", "distlab.checks"},
        "distlab.gpt.build": {"distlab.gpt.layout", "distlab.log_line"},
        "distlab.gpt.layout": {"distlab.logs.formats"},  # the injected cycle: gpt -> logs -> gpt
        "distlab.logs.formats": set(),
        "distlab.checks": {"distlab.logs.megatron"},  # through a root module: not a package's edge
        "distlab.log_line": set(),
    }
    packages = package_graph(graph, frozenset({"gpt", "logs"}))
    assert packages == {"distlab.gpt": {"distlab.logs"}, "distlab.logs": {"distlab.gpt"}}
    assert find_cycle(packages) == ["distlab.gpt", "distlab.logs", "distlab.gpt"]
    del graph["distlab.gpt.layout"]
    assert find_cycle(package_graph(graph, frozenset({"gpt", "logs"}))) is None


# --- the GPT engine's layers --------------------------------------------------------------------

GPT = PACKAGE / "gpt"
#: distlab.gpt's root modules and subpackages from the bottom up: each may import only its own
#: layer and those before it (the training loop down to the layers, never back up). Mirrors the
#: reading order of distlab/gpt/__init__.py's docstring; a new subpackage takes its place here.
LAYERS = (
    "layout",
    "model_layout",
    "interfaces",
    "parallel_state",
    "data",
    "tensor_parallel",
    "context_parallel",
    "transformer",
    "pipeline_parallel",
    "deepspeed",
    "distributed",
    "optimizer",
    "checkpointing",
    "training",
    "arguments",
    "native",
    "memory",
    "build",
    "planning",
    "pretrain",
    "inference",
    "tools",
)
MAX_ROOT_MODULES = 7  # __init__.py included
MIN_SUBPACKAGES = 5
MAX_LINES = 450


def layer_of(module: str) -> str | None:
    """``distlab.gpt.training.log`` -> ``training``; None outside distlab.gpt or for the package itself."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["distlab", "gpt"] and len(parts) > 2 else None


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Every import of a module from a later layer than the importer's, as ``a -> b``."""
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for module, imported in sorted(graph.items()):
        here = layer_of(module)
        for other in sorted(imported):
            there = layer_of(other)
            if here is not None and there is not None and rank[there] > rank[here]:
                bad.append(f"{module} ({here}) -> {other} ({there})")
    return bad


def test_every_gpt_module_has_a_layer() -> None:
    found = {layer_of(module_name(p)) for p in GPT.rglob("*.py")} - {None}
    assert found == set(LAYERS), (
        f"not in LAYERS: {sorted(found - set(LAYERS))}; gone: {sorted(set(LAYERS) - found)}"
    )


def test_gpt_imports_run_down_the_layers() -> None:
    graph = import_graph()
    assert "distlab.gpt.build" in graph["distlab.gpt.pretrain"]  # the walk sees the engine's imports
    bad = upward_imports(graph, LAYERS)
    assert not bad, "a lower layer imports a higher one (see LAYERS):\n" + "\n".join(bad)


def test_the_layer_check_names_an_upward_import() -> None:
    graph = {
        "distlab.gpt.model.x": {"distlab.gpt.training.y"},
        "distlab.gpt.training.y": {"distlab.gpt.model.x"},
    }
    assert upward_imports(graph, ("model", "training")) == [
        "distlab.gpt.model.x (model) -> distlab.gpt.training.y (training)"
    ]


def test_gpt_is_laid_out_in_subpackages() -> None:
    root = sorted(p.name for p in GPT.glob("*.py"))
    subpackages = sorted(p.parent.name for p in GPT.glob("*/__init__.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at distlab/gpt/'s root: {root}"
    assert len(subpackages) >= MIN_SUBPACKAGES, subpackages
    assert not [
        p
        for p in GPT.glob("*/*")
        if p.is_dir() and p.name != "__pycache__" and not (p / "__init__.py").exists()
    ]


def test_no_gpt_module_is_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(GPT)): n
        for p in GPT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


#: Megatron Core's rule: the core never imports its command line. These packages take typed
#: configs, which ``arguments/to_configs.py`` builds from the flags, once.
CORE = ("transformer", "optimizer", "distributed", "checkpointing", "training")
ARGUMENTS = "distlab.gpt.arguments"


def command_line_imports(source: str, package: str) -> list[str]:
    """The modules of :data:`ARGUMENTS` that ``source`` imports, ``TYPE_CHECKING`` blocks included."""
    named = named_modules(source, package, type_checking=True)
    return sorted(m for m in named if m == ARGUMENTS or m.startswith(ARGUMENTS + "."))


def test_the_core_never_imports_the_command_line() -> None:
    found = {
        str(path.relative_to(GPT)): bad
        for layer in CORE
        for path in sorted((GPT / layer).rglob("*.py"))
        if (bad := command_line_imports(path.read_text(), f"distlab.gpt.{layer}"))
    }
    assert not found, f"{', '.join(CORE)} take typed configs, never the arguments (to_configs.py): {found}"


def test_the_command_line_check_sees_every_kind_of_import() -> None:
    source = """
from typing import TYPE_CHECKING
from ..arguments.groups import PretrainArgs
if TYPE_CHECKING:
    from distlab.gpt import arguments
def f():
    import distlab.gpt.arguments.parser
"""
    assert command_line_imports(source, "distlab.gpt.training") == [
        "distlab.gpt.arguments",
        "distlab.gpt.arguments.groups",
        "distlab.gpt.arguments.groups.PretrainArgs",
        "distlab.gpt.arguments.parser",
    ]


def test_the_package_docstring_maps_the_layers_in_order() -> None:
    import distlab.gpt

    doc = distlab.gpt.__doc__.split("The map, in reading order", 1)[1]  # below the Megatron Core table
    entries = [
        line.split()[0] for line in doc.splitlines() if line.startswith("    ") and line[4:5].isalpha()
    ]
    mapped = [e.removesuffix(".py").removesuffix("/") for e in entries if e.endswith((".py", "/"))]
    assert mapped == list(LAYERS), f"distlab/gpt/__init__.py's map {mapped} is not LAYERS {list(LAYERS)}"
