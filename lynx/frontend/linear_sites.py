"""The linear layers a captured graph calls, as tensor-parallel sharding sees them.

:func:`linear_sites` lists every ``aten.linear`` whose weight is a parameter, in graph order,
as a :class:`LinearSite`: its module path, weight and bias, its features, the equal parts its
output is split into along the features (GPT's fused ``qkv(x).split(C, dim=2)``: 3) and, per
part, the heads of the first view splitting those features into ``(heads, head_dim)``. What
shards them: :mod:`lynx.frontend.sharding`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

__all__ = ["LinearSite", "linear_sites"]

_LINEAR = torch.ops.aten.linear.default
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.unflatten.int)
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default)


@dataclass(frozen=True)
class LinearSite:
    """A linear layer as the captured graph calls it."""

    node: str                 # the captured ``aten.linear`` node
    path: str                 # module path (the weight's name without ``.weight``)
    weight: str               # get_attr target of the weight
    bias: str | None          # ... of the bias
    out_features: int
    in_features: int
    parts: int                # equal parts its output is split into along the features (1: not split)
    heads: tuple[int, ...]    # per part: heads of the first view splitting the features (0: none)


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def _split_parts(node: fx.Node, features: int) -> tuple[int, list[fx.Node]]:
    """``(k, pieces)`` when every user of ``node`` splits it into ``k`` equal parts along the
    last dimension (the pieces are the ``getitem`` nodes), else ``(1, [node])``."""
    users = list(node.users)
    if not users or any(u.target not in _SPLITS for u in users):
        return 1, [node]
    ndim = len(_shape(node) or ())
    counts = set()
    for u in users:
        dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
        if dim not in (-1, ndim - 1):
            return 1, [node]
        arg: Any = u.args[1]
        if u.target is torch.ops.aten.chunk.default:
            k = int(arg)
        elif isinstance(arg, int):
            k = features // arg if features % arg == 0 else 0
        else:
            k = len(arg) if len(set(arg)) == 1 else 0
        counts.add(k)
    if len(counts) != 1 or counts == {0} or counts == {1}:
        return 1, [node]
    pieces = [g for u in users for g in u.users if g.target is operator.getitem]
    return counts.pop(), pieces


def _heads(piece: fx.Node) -> int:
    """Heads of the first view that splits ``piece``'s last dimension in two (0: none found)."""
    shape = _shape(piece)
    if not shape:
        return 0
    stack, seen = [piece], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target in _VIEWS:
                out = _shape(u)
                if out and len(out) >= 2 and out[-2] * out[-1] == shape[-1] and out[-2] != 1 and out[-1] != shape[-1]:
                    return out[-2]
            elif u.target is torch.ops.aten.contiguous.default or u.target is torch.ops.aten.clone.default:
                stack.append(u)
    return 0


def linear_sites(gm: fx.GraphModule) -> list[LinearSite]:
    """Every ``aten.linear`` of the captured graph whose weight is a parameter, in graph order."""
    sites = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not _LINEAR:
            continue
        weight = n.args[1]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            continue
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        target = str(weight.target)
        w_shape = _shape(weight) or tuple(_attr(gm, target).shape)
        out_features, in_features = int(w_shape[0]), int(w_shape[1])
        parts, pieces = _split_parts(n, out_features)
        sites.append(LinearSite(node=n.name, path=target.rsplit(".", 1)[0], weight=target,
                                bias=str(bias.target) if isinstance(bias, fx.Node) and bias.op == "get_attr" else None,
                                out_features=out_features, in_features=in_features, parts=parts,
                                heads=tuple(_heads(p) for p in pieces)))
    return sites


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
