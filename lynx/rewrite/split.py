"""Split a captured graph into pipeline stages along the plan's node assignment.

Each stage becomes its own ``fx.GraphModule`` whose ``get_attr`` nodes point at the original
parameters and buffers (``GraphModule`` copies attribute *references*, never tensors), so a
stage trains the user's model itself. A stage's inputs are the model inputs it reads directly
(microbatch data every rank has) followed by the values it receives from the previous stage;
its outputs are the values the next stage needs (values used further down pass through), and
for the last stage whatever the model returns.

Example::

    >>> import torch
    >>> from torch import fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> ops = [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    >>> parts = split_graph(gm, [[ops[0]], [ops[1]]])
    >>> [p.spec.recv for p in parts], [p.spec.send for p in parts]
    ([[], ['_0']], [['_0'], []])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from lynx.errors import LynxPlanError
from lynx.torch_private import out_spec_of

__all__ = ["StageSpec", "StageGraph", "split_graph", "op_nodes"]

_OPS = ("call_function", "call_method", "call_module")


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Executable nodes of ``gm`` in order (export's unused ``_guards_fn`` check left out)."""
    return [n for n in gm.graph.nodes if n.op in _OPS and not (n.op == "call_module" and n.target == "_guards_fn")]


@dataclass(frozen=True)
class StageSpec:
    """Names crossing one stage's boundary (fx node names of the full graph)."""

    index: int
    nodes: list[str]          # the stage's op nodes, forward order
    inputs: list[str]         # model inputs (placeholders) the stage reads directly
    recv: list[str]           # values received from the previous stage
    send: list[str]           # values sent to the next stage ([] on the last stage)
    is_last: bool


@dataclass
class StageGraph:
    gm: fx.GraphModule        # placeholders: inputs + recv; output: tuple(send) or the model's output
    spec: StageSpec
    out_spec: Any = None      # the captured module's output pytree (last stage returns it unflattened)

    @property
    def attr_names(self) -> set[str]:
        """The parameters and buffers the stage reads (its ``get_attr`` targets), by the model's names."""
        return {str(n.target) for n in self.gm.graph.nodes if n.op == "get_attr"}


def split_graph(gm: fx.GraphModule, stage_nodes: Sequence[Sequence[str]]) -> list[StageGraph]:
    """Split ``gm`` into ``len(stage_nodes)`` stages; ``stage_nodes[s]`` names stage s's op nodes.

    Op nodes named in no stage (rare glue such as a shape computation) join the earliest stage
    that has all of their inputs. A node that reads a value computed by a later stage makes
    the split impossible: :class:`LynxPlanError` names it.
    """
    ops = op_nodes(gm)
    stage_of: dict[str, int] = {}
    for s, names in enumerate(stage_nodes):
        for name in names:
            stage_of[name] = s
    known = {n.name for n in gm.graph.nodes}
    unknown = sorted(set(stage_of) - known)
    if unknown:
        raise LynxPlanError(f"stage assignment names nodes not in the graph: {unknown[:5]}; "
                            "the plan was made for another model (re-plan it)")
    for node in ops:  # topological: inputs are assigned before users
        producer_stages = [stage_of[a.name] for a in node.all_input_nodes if a.name in stage_of]
        if node.name not in stage_of:
            stage_of[node.name] = max(producer_stages, default=0)
        elif producer_stages and max(producer_stages) > stage_of[node.name]:
            bad = next(a.name for a in node.all_input_nodes if stage_of.get(a.name, -1) > stage_of[node.name])
            raise LynxPlanError(
                f"node {node.name} (stage {stage_of[node.name]}) reads {bad} from a later stage "
                f"{stage_of[bad]}; stages must follow the forward order")

    n_stages = len(stage_nodes)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    # last stage that needs each op value (the model output counts as the last stage)
    last_need: dict[str, int] = {}
    for node in ops + [output_node]:
        s = n_stages - 1 if node is output_node else stage_of[node.name]
        for a in node.all_input_nodes:
            if a.op in _OPS:
                last_need[a.name] = max(last_need.get(a.name, -1), s)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    # boundary[s]: values produced before stage s and needed at stage s or later
    boundary: list[list[str]] = []
    for s in range(n_stages):
        live = [a for a, need in last_need.items() if stage_of[a] < s <= need]
        boundary.append(sorted(live, key=order.__getitem__))

    result = []
    for s in range(n_stages):
        members = [n for n in ops if stage_of[n.name] == s]
        is_last = s == n_stages - 1
        send = [] if is_last else boundary[s + 1]
        part = _build_stage(gm, s, members, boundary[s], send, is_last, output_node)
        part.out_spec = out_spec_of(gm)
        result.append(part)
    return result


def _build_stage(gm: fx.GraphModule, s: int, members: list[fx.Node], recv: list[str], send: list[str],
                 is_last: bool, output_node: fx.Node) -> StageGraph:
    by_name = {n.name: n for n in gm.graph.nodes}
    needed = [a for n in members for a in n.all_input_nodes]
    if is_last:
        needed += output_node.all_input_nodes
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder" and n in needed]

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in inputs + recv:
        env[name] = graph.placeholder(name)
        env[name].meta = {**by_name[name].meta, "lynx_name": name}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node in needed:
            env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    for node in members:
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
        env[node.name].meta["lynx_name"] = node.name  # fx may rename; the plan uses full-graph names
    if is_last:
        graph.output(fx.map_arg(output_node.args[0], lambda a: env[a.name]))
    else:
        graph.output(tuple(env[name] for name in send))
    missing = [n for n in send if n not in env]
    if missing:
        raise LynxPlanError(f"stage {s} must send {missing} but neither computes nor receives them")
    stage_gm = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
    spec = StageSpec(index=s, nodes=[n.name for n in members], inputs=inputs, recv=list(recv), send=list(send),
                     is_last=is_last)
    return StageGraph(stage_gm, spec)
