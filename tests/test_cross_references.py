"""Every cross-reference resolves: a module, function or class moved or renamed leaves none dangling.

Checked:

* every Sphinx role target (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``,
  ``:data:``, ``:exc:``) in the docstrings of ``lynx/``: an absolute target
  (``lynx.rewrite.lower``, ``torch.compile``) is imported, a relative one (``lower``,
  ``LoweredStage.backward_graph``) is looked up in the enclosing class, then the module;
* every ``lynx.x.y`` mention in ``lynx/`` (docstrings, comments, strings), ``docs/`` and the README;
* every file path with an extension under ``lynx/``, ``tests/``, ``benchmarks/``, ``examples/``,
  ``scripts/`` or ``docs/`` mentioned in ``docs/``, the README and ``lynx/``.

An attribute counts when the object has it, or declares it as a dataclass or pydantic field.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(mod|func|class|meth|attr|data|exc|obj):`([^`]+)`")
MENTION = re.compile(r"(?<![\w./-])lynx(?:\.[A-Za-z_]\w*)+(?![\w-])")
FILE = re.compile(r"(?<![\w/.~-])((?:lynx|tests|benchmarks|examples|scripts|docs)/"
                  r"[\w/.-]*\.(?:py|md|json|yaml|sh|csv|txt))(?![\w/])")
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
SOURCES = sorted((ROOT / "lynx").rglob("*.py"))


def _has(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if name in (getattr(obj, "model_fields", None) or {}):  # a pydantic field
        return True
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return name in {f.name for f in dataclasses.fields(obj)}
    return False


def _walk(obj: Any, parts: list[str]) -> bool:
    for part in parts:
        if not _has(obj, part):
            return False
        obj = getattr(obj, part, None)
    return True


def resolves(target: str, scopes: tuple[Any, ...] = ()) -> bool:
    """Whether ``target`` names something: relative to ``scopes`` (innermost first), else absolute."""
    target = target.strip().lstrip("~.").removesuffix("()")
    parts = target.split(".")
    if any(_walk(scope, parts) for scope in scopes if scope is not None):
        return True
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _walk(module, parts[i:])
    return False


def _module_of(path: Path) -> ModuleType:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))


def _docstrings(path: Path) -> list[tuple[int, str, tuple[Any, ...]]]:
    """``(line, docstring, scopes)`` for the module and every class and function in it."""
    module = _module_of(path)
    found: list[tuple[int, str, tuple[Any, ...]]] = []

    def visit(node: ast.AST, cls: Any) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                inner = getattr(cls if cls is not None else module, child.name, None)
                doc = ast.get_docstring(child)
                if doc:
                    found.append((child.lineno, doc, (inner, cls, module)))
                visit(child, inner)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child)
                if doc:
                    found.append((child.lineno, doc, (cls, module)))
                visit(child, cls)

    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    if doc:
        found.append((1, doc, (module,)))
    visit(tree, None)
    return found


def dangling_roles(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: :{m.group(1)}:`{m.group(2)}`"
            for line, doc, scopes in _docstrings(path) for m in ROLE.finditer(doc)
            if not resolves(m.group(2), scopes)]


def dangling_mentions(path: Path) -> list[str]:
    out = []
    for i, text in enumerate(path.read_text().splitlines(), 1):
        out += [f"{path.relative_to(ROOT)}:{i}: {m.group(0)}" for m in MENTION.finditer(text)
                if not resolves(m.group(0))]
        out += [f"{path.relative_to(ROOT)}:{i}: {m.group(1)}" for m in FILE.finditer(text)
                if not (ROOT / m.group(1)).exists()]
    return out


def test_docstring_roles_resolve() -> None:
    bad = [b for path in SOURCES for b in dangling_roles(path)]
    assert not bad, "dangling references in docstrings:\n" + "\n".join(bad)


def test_lynx_mentions_and_paths_resolve() -> None:
    bad = [b for path in [*DOCS, *SOURCES] for b in dangling_mentions(path)]
    assert not bad, "dangling mentions:\n" + "\n".join(bad)


@pytest.mark.parametrize("target, scopes, expected", [
    ("lynx.rewrite.lower.lower", (), True),
    ("~lynx.plan.Plan.save", (), True),
    ("lynx.Plan.timeline", (), True),            # a pydantic field
    ("lynx.rewrite.joint", (), False),           # moved to lynx.frontend.joint
    ("lynx.runtime.schedule", (), False),        # moved to lynx.planner.schedule
    ("torch.compile", (), True),
    ("lower", ("lynx.rewrite.lower",), True),
    ("lower", ("lynx.frontend.joint",), False),  # not defined, nor imported, there
])
def test_resolution(target: str, scopes: tuple[str, ...], expected: bool) -> None:
    assert resolves(target, tuple(importlib.import_module(s) for s in scopes)) is expected


def test_mentions_are_found() -> None:
    text = "see ``lynx.rewrite.joint`` and `lynx.runtime.schedule`, lynx/runtime/nothing.py, not lynx.egg-info/"
    found = [m.group(0) for m in MENTION.finditer(text)] + [m.group(1) for m in FILE.finditer(text)]
    assert found == ["lynx.rewrite.joint", "lynx.runtime.schedule", "lynx/runtime/nothing.py"]
