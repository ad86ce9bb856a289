"""The profile of one tensor-parallel rank: which ops run on shards, and the collectives per layer.

:func:`annotate_tp` marks the op graph (what the planner reads) with what a TP rank of the
:class:`~lynx.frontend.sharding.ShardingPlan` really holds and runs, following the sharding
through the captured graph as :class:`~lynx.frontend.joint_tp.TPRunner` runs it:

* ``tp_compute`` — ``"shard"`` where the op runs on 1/tp of the work (sharded linears and every
  op reading a sharded value), ``"replicate"`` where each rank runs it whole (norms, residual
  adds, embeddings, the head, the loss);
* ``tp_output`` — whether its result (and so what autograd saves of it) is a shard
  (``"shard"``: 1/tp of the bytes) or whole: a row-parallel linear computes on shards but its
  all-reduced output is whole;
* ``tp_allreduce`` — ``(forward bytes, backward bytes)`` of the all-reduces the op issues: a
  row-parallel linear all-reduces its output in the forward; the first column-parallel linear
  reading a value all-reduces that value's gradient in the backward (once for every
  column-parallel reader: :mod:`lynx.frontend.joint_tp`).

The planner (:mod:`lynx.planner.tp_costs`) scales FLOP times and saved bytes by these and
prices the all-reduces on the TP link; blocks get ``tp_sharded_param_bytes``. The runtime checks
the collectives of the traced sharded joint graph against :func:`expected_collectives` and
refuses a stage that issues others.

Example::

    >>> import lynx
    >>> from lynx.frontend.analyze import analyze
    >>> from lynx.frontend.sharding import resolve_sharding
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    >>> a = analyze(model, inputs, hardware="cpu-local")
    >>> annotate_tp(a.graph, a.captured.gm, resolve_sharding(a.captured.gm, a.graph.graph["blocks"], tp=2))
    >>> per_layer = expected_collectives(a.graph)
    >>> per_layer[0]["forward"], per_layer[0]["backward"]   # bytes of each all-reduce in layer 0
    ([8192, 8192], [8192, 8192])
"""

from __future__ import annotations

import re
from typing import Any

import networkx as nx
import torch
from torch import fx

from lynx.frontend.sharding import ShardingPlan, linear_sites

__all__ = ["annotate_tp", "expected_collectives", "base_name", "apply_sharding"]

_CLONE = re.compile(r"__L\d+$")


def base_name(node: str) -> str:
    """The captured node behind an op-graph node (an unfolded layer's clone ``x__L7`` is ``x``)."""
    return _CLONE.sub("", node)


def _nbytes(n: Any) -> int:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


def annotate_tp(graph: nx.DiGraph, gm: fx.GraphModule, plan: ShardingPlan) -> None:
    """Mark ``graph``'s nodes and blocks for ``plan`` (module docstring); idempotent."""
    sites = {s.node: s for s in linear_sites(gm)}
    sharded: dict[str, bool] = {}
    marks: dict[str, tuple[str, str, int, int]] = {}
    reduced: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        site = sites.get(n.name)
        shard = plan.shards.get(site.path) if site is not None else None
        if shard is not None and shard.style == "colwise":
            x = n.args[0]
            backward = _nbytes(x) if isinstance(x, fx.Node) and x not in reduced else 0
            if isinstance(x, fx.Node):
                reduced.add(x)
            marks[n.name] = ("shard", "shard", 0, backward)
            sharded[n.name] = True
        elif shard is not None:
            marks[n.name] = ("shard", "replicate", _nbytes(n), 0)
            sharded[n.name] = False
        else:
            on_shards = any(sharded.get(a.name, False) for a in n.all_input_nodes)
            sharded[n.name] = on_shards
            marks[n.name] = ("shard", "shard", 0, 0) if on_shards else ("replicate", "replicate", 0, 0)
    for name, attrs in graph.nodes(data=True):
        compute, output, forward, backward = marks.get(base_name(name), ("replicate", "replicate", 0, 0))
        attrs.update(tp_compute=compute, tp_output=output, tp_allreduce=(forward, backward))
    params = dict(gm.named_parameters())
    shard_bytes: dict[str, int] = {}
    for name, p in params.items():
        if plan.sharded_params([name]):
            shard_bytes[name] = p.numel() * p.element_size()
    for block in graph.graph["blocks"]:
        prefix = block["module_path"] + "." if block["kind"] == "layer" and block["module_path"] else None
        block["tp_sharded_param_bytes"] = sum(b for n, b in shard_bytes.items()
                                              if prefix is not None and n.startswith(prefix))
    graph.graph["tp_plan"] = plan.record()
    plan.collectives = expected_collectives(graph)


def expected_collectives(graph: nx.DiGraph) -> dict[Any, dict[str, list[int]]]:
    """Per layer (``None``: edge blocks), the bytes of each all-reduce its forward and its
    backward issue, in the order they run (forward order; the backward runs them reversed)."""
    out: dict[Any, dict[str, list[int]]] = {}
    for block in graph.graph["blocks"]:
        for n in block["nodes"]:
            forward, backward = graph.nodes[n].get("tp_allreduce", (0, 0))
            entry = out.setdefault(block.get("layer"), {"forward": [], "backward": []})
            if forward:
                entry["forward"].append(int(forward))
            if backward:
                entry["backward"].append(int(backward))
    return out


def apply_sharding(analysis: Any, config: Any) -> tuple[Any, ShardingPlan | None]:
    """For ``config.tp > 1``: the sharding plan of ``analysis``'s model
    (:func:`~lynx.frontend.sharding.resolve_sharding` of ``config.tp_plan``), its marks on the
    op graph, and ``config`` with the plan recorded (``tp_plan`` as strings, what a saved plan
    holds and its fingerprint covers). ``(config, None)`` for tp = 1."""
    if config.tp <= 1:
        return config, None
    from lynx.frontend.sharding import resolve_sharding

    if analysis.captured.method != "export":
        from lynx.errors import LynxConfigError

        raise LynxConfigError("tensor parallelism needs a torch.export capture of the model (this one fell back to "
                              f"{analysis.captured.method}: {analysis.captured.export_error}); use tp=1")
    plan = resolve_sharding(analysis.captured.gm, analysis.graph.graph["blocks"], config.tp, config.tp_plan)
    annotate_tp(analysis.graph, analysis.captured.gm, plan)
    return config.replace(tp_plan=plan.record()), plan
