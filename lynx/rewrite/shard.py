"""A pipeline stage's graph holding one tensor-parallel rank's shards instead of the whole weights.

:func:`shard_stage` copies a split stage (:class:`~lynx.rewrite.split.StageGraph`) so its
``get_attr`` targets are this TP rank's tensors under the model's own names: the sharded
linears' local pieces as new ``nn.Parameter`` s
(:func:`~lynx.frontend.sharding.shard_tensor`), every other parameter and buffer the user's own
tensor (replicated: each TP rank trains it whole, with the same gradient on every rank). The
stage's optimizer and checkpoints then see exactly what the rank holds. The graph itself is
unchanged: :class:`~lynx.frontend.joint_tp.TPRunner` runs it tensor-parallel when the joint
graph is traced.

Example::

    >>> import torch, lynx
    >>> from lynx.frontend.sharding import ShardingPlan, LinearShard
    >>> from lynx.rewrite.split import split_graph, op_nodes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.export.export(model, (torch.randn(2, 4),), strict=False).module()
    >>> part = split_graph(gm, [[n.name for n in op_nodes(gm)]])[0]
    >>> plan = ShardingPlan(tp=2, shards={"0": LinearShard("colwise"), "2": LinearShard("rowwise")})
    >>> mine = shard_stage(part, plan, rank=1)
    >>> tuple(mine.gm.get_parameter("0.weight").shape), tuple(mine.gm.get_parameter("2.weight").shape)
    ((4, 4), (4, 4))
    >>> mine.gm.get_parameter("2.bias") is gm.get_parameter("2.bias")   # replicated: the model's own
    True
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx

from lynx.frontend.joint import fetch_attr
from lynx.frontend.joint_tp import local_shards
from lynx.frontend.sharding import ShardingPlan
from lynx.rewrite.split import StageGraph

__all__ = ["shard_stage"]


def shard_stage(part: StageGraph, plan: ShardingPlan, rank: int) -> StageGraph:
    """``part`` with TP rank ``rank``'s shards as its parameters (see module docstring)."""
    tensors = local_shards(part.gm, plan, rank)
    sharded = plan.sharded_params(list(tensors))
    root: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name in sharded:
            original = fetch_attr(part.gm, name)
            value = torch.nn.Parameter(value, requires_grad=original.requires_grad)
        root[name] = value
    graph = fx.Graph()   # a copy: the joint trace annotates nodes, and each module owns its graph
    graph.output(graph.graph_copy(part.gm.graph, {}))
    gm = fx.GraphModule(root, graph, class_name=type(part.gm).__name__)
    gm.meta.update({k: v for k, v in part.gm.meta.items() if k != "lynx_joint"})
    # the joint graph depends on the graph, the input signature and the sharding (its cache key),
    # not on the tensors: every shard of this stage built on this rank shares the traces
    gm.meta["lynx_joint"] = part.gm.meta.setdefault("lynx_joint_sharded", {})
    return replace(part, gm=gm)
