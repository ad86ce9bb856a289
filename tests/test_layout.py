"""The package's shape: no import cycles, a torch-free planner, no private names across modules.

The import graph is read statically (``ast``) from every module under ``lynx/``: an import
inside a function counts as much as one at the top (a lazy import hides a cycle, it does not
remove it); imports under ``if TYPE_CHECKING:`` do not count. Importing ``lynx.a.b`` first runs
``lynx/__init__.py`` and ``lynx/a/__init__.py``: what a module reaches includes what its parent
packages import (:func:`_with_parents`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1] / "lynx"

# The planning core: what runs on a laptop to plan a 20B model. None of it may need torch.
TORCH_FREE = ("lynx.planner", "lynx.solvers", "lynx.plan", "lynx.config", "lynx.units", "lynx.errors",
              "lynx.viz")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, modules: set[str]) -> list[tuple[str, list[str]]]:
    """``(imported module, names)`` pairs; ``from lynx.x import y`` resolves y to a module if it is one."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}: use absolute imports (from lynx.x import y)"
            base = node.module or ""
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            found.append((base, [n for n in names if f"{base}.{n}" not in modules]))
            found.extend((sub, []) for sub in submodules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _is_package(module: str) -> bool:
    return (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()


def _graph() -> tuple[nx.DiGraph, dict[str, set[str]], list[tuple[str, str, str]]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    external: dict[str, set[str]] = {m: set() for m in modules}
    private: list[tuple[str, str, str]] = []
    for module, path in paths.items():
        for target, names in _imports(ast.parse(path.read_text(), str(path)), module, modules):
            if target in modules:
                if target != module:
                    graph.add_edge(module, target)
                private.extend((module, target, n) for n in names if n.startswith("_") and not n.startswith("__"))
            elif target.split(".")[0] != "lynx":
                external[module].add(target.split(".")[0])
    return graph, external, private


GRAPH, EXTERNAL, PRIVATE = _graph()


def _without_package_inits(graph: nx.DiGraph) -> nx.DiGraph:
    """A package's ``__init__`` importing its own submodules (a registry, lazy re-exports) is the
    package, not a cycle: drop edges from a package to modules inside it."""
    kept = nx.DiGraph()
    kept.add_nodes_from(graph)
    kept.add_edges_from((a, b) for a, b in graph.edges if not (_is_package(a) and b.startswith(a + ".")))
    return kept


def _parents(module: str) -> list[str]:
    """The packages Python initialises before ``module``: ``lynx.a.b`` → ``lynx``, ``lynx.a``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _with_parents(graph: nx.DiGraph) -> nx.DiGraph:
    """The import graph plus an edge from each module to its parent packages (their ``__init__``
    runs first), with the packages' own imports of their submodules kept: what importing a
    module really executes."""
    full = graph.copy()
    full.add_edges_from((m, p) for m in graph for p in _parents(m) if p in graph)
    return full


def test_no_import_cycles() -> None:
    cycles = list(nx.simple_cycles(_without_package_inits(GRAPH)))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def _torch_reached(graph: nx.DiGraph, module: str) -> list[str]:
    """The modules importing ``module`` executes (parent packages included) that import torch."""
    reach = {module, *nx.descendants(_with_parents(graph), module)}
    return sorted(m for m in reach if "torch" in EXTERNAL[m])


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_planning_core_imports_no_torch(prefix: str) -> None:
    core = [m for m in GRAPH if m == prefix or m.startswith(prefix + ".")]
    assert core, f"no module under {prefix}"
    for module in core:
        offenders = _torch_reached(GRAPH, module)
        assert not offenders, f"{module} reaches torch through {offenders}"


def test_parent_packages_are_modelled() -> None:
    # what lynx/__init__.py once did (the process-group guard): the planner would load torch
    graph = GRAPH.copy()
    graph.add_edge("lynx", "lynx.process_group_guard")
    assert "lynx.process_group_guard" in _torch_reached(graph, "lynx.planner.schedule")


def test_no_private_names_imported_across_modules() -> None:
    assert not PRIVATE, "private names imported: " + ", ".join(f"{a} imports {t}.{n}" for a, t, n in PRIVATE)


def test_every_package_says_what_it_holds() -> None:
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, (
            f"{init.relative_to(ROOT.parent)} needs a docstring: what it holds, what it imports"
        )


def test_only_the_harness_imports_the_harness() -> None:
    """The test harness (spawned worlds, token batches, hand plans, the reference executor) lives
    in ``lynx.testing``; the library itself never depends on it."""
    inside = {m for m in GRAPH if m == "lynx.testing" or m.startswith("lynx.testing.")}
    offenders = sorted(m for m in GRAPH if m not in inside and set(GRAPH.successors(m)) & inside)
    assert not offenders, f"modules outside lynx/testing import the harness: {offenders}"


def test_runtime_exports_what_a_training_script_calls() -> None:
    """One driver (``Pipeline``) and what a training loop around it uses; no harness, no runner."""
    import lynx.runtime

    assert "Pipeline" in lynx.runtime.__all__ and len(lynx.runtime.__all__) <= 12, lynx.runtime.__all__
    assert not {"StageRunner", "spawn", "run_local", "WorkerSpec"} & set(lynx.runtime.__all__)
    for name in lynx.runtime.__all__:
        assert getattr(lynx.runtime, name) is not None
