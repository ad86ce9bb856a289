"""Generated graphs run with their operator calls bound directly, not looked up per call.

fx writes a call of an operator overload as ``torch.ops.aten.mm.default(a, b)``: per call, four
attribute lookups and a Python frame (``OpOverload.__call__``, which only forwards to the
overload's ``_op``) before the operator's own argument parsing. A stage's backward graph makes
about 40 such calls per transformer layer and microbatch, most of them views that cost less
than the call itself; autograd's engine, which Lynx's backward replaces, calls the same
operators from C++. :func:`bind_calls` recompiles a graph module's generated code with each
such call made to the overload's ``_op`` — the very function ``OpOverload.__call__`` calls,
so the ops, their arguments and their order are unchanged — saving about 1 µs per call. The
commonest overloads (views, matmuls, sums, copies: four in five of a transformer backward's
calls) go to torch's Python bindings instead (``torch.Tensor.view``, ``torch.mm``, ...), whose
argument parser is another 1–2 µs faster than ``_op``'s: each is listed with the one overload
its binding picks for the arguments the schema allows (tensors, ints, int lists, bools, no
numbers that could pick a ``Scalar`` overload), so the same kernel runs.

Example::

    >>> import torch
    >>> from torch import fx
    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> _ = g.output((g.call_function(torch.ops.aten.neg.default, (x,)),))
    >>> gm = fx.GraphModule({}, g)
    >>> run = bind_calls(gm)
    >>> run(torch.ones(2))[0]
    tensor([-1., -1.])
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any

from torch import fx

from lynx.torch_private import is_op_overload, op_function

__all__ = ["bind_calls"]

# what fx writes for a call of an operator overload (its qualified name, then the call)
_OP_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\(")


def _bindings() -> dict[Any, Any]:
    """Overload -> the public binding that dispatches to exactly that overload for every
    argument list its schema accepts (checked by hand against ``native_functions.yaml``: the
    binding's other overloads differ in an argument's type — a dtype, Dimnames, a Scalar)."""
    import torch

    aten = torch.ops.aten
    return {aten.view.default: torch.Tensor.view, aten.t.default: torch.t, aten.transpose.int: torch.transpose,
            aten.mm.default: torch.mm, aten.bmm.default: torch.bmm, aten.sum.dim_IntList: torch.sum,
            aten.clone.default: torch.clone, aten.detach.default: torch.detach, aten.cat.default: torch.cat,
            aten.expand.default: torch.Tensor.expand, aten.permute.default: torch.permute,
            aten.add_.Tensor: torch.Tensor.add_}


def bind_calls(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s ``forward`` with each operator-overload call made to the overload's ``_op``
    (see the module docstring); calls it cannot resolve stay as fx wrote them."""
    import torch   # the generated code's own name for the operators' root

    forward = type(gm).forward   # fx's compiled function: its globals are the code's names
    globals_: dict[str, Any] = dict(forward.__globals__)
    bound: dict[str, str] = {}
    bindings = _bindings()

    def substitute(match: re.Match) -> str:
        qualified = match.group(0)[:-1]
        name = bound.get(qualified)
        if name is None:
            try:
                op = getattr(getattr(getattr(torch.ops, match.group(1)), match.group(2)), match.group(3))
            except AttributeError:
                return match.group(0)
            if not is_op_overload(op):
                return match.group(0)
            name = bound[qualified] = f"_lynx_op_{len(bound)}"
            globals_[name] = bindings.get(op) or op_function(op)
        return name + "("

    source = _OP_CALL.sub(substitute, gm.code)
    if not bound:
        return gm
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<lynx bound {type(gm).__name__}>", "exec"), globals_, namespace)  # noqa: S102 - fx's own code
    return types.MethodType(namespace["forward"], gm)
