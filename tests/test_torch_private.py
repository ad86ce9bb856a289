"""Private torch APIs go through ``lynx/torch_private.py`` only, and it finds every one it lists.

Read statically (``ast``) from every module under ``lynx/`` but the adapter. A use is private
when it is

* an import of a private torch module or name (``from torch._subclasses import ...``,
  ``import torch.utils._pytree``, ``from torch.fx.graph import _BoxedCodeGen``);
* an attribute path from a name bound to torch with a private part (``torch._C._dispatch_...``,
  ``fx.graph._BoxedCodeGen``, ``dist.distributed_c10d._get_default_store``), except operator
  names under ``torch.ops`` (``torch.ops.aten._softmax`` is an op, not a Python API);
* ``getattr``/``hasattr``/``setattr`` with a private name (``getattr(gm, "_out_spec")``);
* ``x._name`` on something other than ``self``/``cls`` or a non-torch module, where no Lynx
  class or module defines ``_name``: someone else's private attribute (``op._schema``,
  ``module._parameters``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lynx.errors import LynxRuntimeError
from lynx.torch_private import VERIFIED_TORCH, check, out_spec_of, private

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "lynx" / "torch_private.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(paths: list[Path]) -> set[str]:
    """Private names Lynx itself defines: attributes set on ``self``/``cls``, class members, module globals."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if _private(n)}


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None when the root is not a plain name."""
    parts: list[str] = []
    value: ast.expr = node
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    return (value.id, parts[::-1]) if isinstance(value, ast.Name) else None


def private_torch_uses(source: str, defined: set[str]) -> list[str]:
    """Each private torch use in ``source``, as ``line: what``."""
    tree = ast.parse(source)
    torch_alias: dict[str, str] = {}   # local name -> dotted torch path it is bound to
    other_modules: set[str] = set()    # local names bound to non-torch modules
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    torch_alias[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                else:
                    other_modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if any(_private(p) for p in full.split(".")):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                torch_alias[alias.asname or alias.name] = full
    seen: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append(f"{node.lineno}: {node.func.id}(..., {name.value!r})")
        if not isinstance(node, ast.Attribute) or id(node) in seen:
            continue
        chain = _chain(node)
        for inner in ast.walk(node):  # report the longest path once, not each prefix
            seen.add(id(inner))
        if chain is None:
            if _private(node.attr) and node.attr not in defined:
                found.append(f"{node.lineno}: .{node.attr}")
            continue
        root, parts = chain
        if root in torch_alias:
            path = [*torch_alias[root].split("."), *parts]
            if path[:2] != ["torch", "ops"] and any(_private(p) for p in path):
                found.append(f"{node.lineno}: {'.'.join(path)}")
        elif root not in ("self", "cls") and root not in other_modules:
            bad = [p for p in parts if _private(p) and p not in defined]
            if bad:
                found.append(f"{node.lineno}: {root}.{'.'.join(parts)}")
    return found


def _lynx_modules() -> list[Path]:
    return sorted((ROOT / "lynx").rglob("*.py"))


def test_no_private_torch_api_outside_the_adapter() -> None:
    paths = _lynx_modules()
    defined = _defined_privates(paths)
    offences = [f"{p.relative_to(ROOT)}:{use}" for p in paths if p != ADAPTER
                for use in private_torch_uses(p.read_text(), defined)]
    assert not offences, ("private torch APIs outside lynx/torch_private.py (add them there, with what "
                          "they are for): " + "; ".join(offences))


@pytest.mark.parametrize("source, expected", [
    ("from torch._subclasses.fake_tensor import FakeTensorMode", "from torch._subclasses.fake_tensor"),
    ("import torch.utils._pytree as pytree", "import torch.utils._pytree"),
    ("from torch.fx.graph import _BoxedCodeGen", "import _BoxedCodeGen"),
    ("import torch\nx = torch._C._dispatch_get_all_op_names()", "torch._C._dispatch_get_all_op_names"),
    ("from torch import fx\nfx.graph._BoxedCodeGen()", "torch.fx.graph._BoxedCodeGen"),
    ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()",
     "torch.distributed.distributed_c10d._get_default_store"),
    ("spec = getattr(gm, '_out_spec', None)", "getattr(..., '_out_spec')"),
    ("returns = target._schema.returns", "target._schema"),
    ("def f(m):\n    m.owner()._parameters['w'] = 1", "._parameters"),
])
def test_the_check_catches(source: str, expected: str) -> None:
    found = private_torch_uses(source, defined={"_mine"})
    assert any(expected in use for use in found), found


@pytest.mark.parametrize("source", [
    "import torch\ntorch.ops.aten._softmax.default",
    "import os\nos._exit(0)",
    "class A:\n    def f(self):\n        return self._x",
    "def f(other):\n    return other._mine",
    "import torch\nx = torch.__version__",
])
def test_the_check_allows(source: str) -> None:
    assert private_torch_uses(source, defined={"_mine"}) == []


def test_every_private_name_resolves_on_this_torch() -> None:
    assert check() == [], "\n".join(check())


def test_a_missing_name_says_what_and_what_to_do() -> None:
    with pytest.raises(LynxRuntimeError) as err:
        private("torch.fx.graph", "_NoSuchCodeGen", "an example")
    message = str(err.value)
    assert f"torch {torch.__version__} has no torch.fx.graph._NoSuchCodeGen" in message
    assert "an example" in message and VERIFIED_TORCH in message and "lynx/torch_private.py" in message


def test_out_spec_is_where_the_adapter_reads_it() -> None:
    gm = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),), strict=False).module()
    assert out_spec_of(gm) is not None
