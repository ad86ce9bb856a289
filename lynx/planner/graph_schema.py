"""The op graph's attribute schema: what the frontend writes and the planner reads.

:func:`lynx.frontend.graph.build_graph` produces a ``networkx.DiGraph`` whose nodes are the
captured graph's ops (``NodeAttrs``) and whose ``graph`` dict holds the block structure
(``GraphAttrs``, ``Block``). These typed dicts are the one definition of that contract;
:func:`check_graph` says, before planning starts, which attribute a graph built elsewhere (a
test fixture, an older Lynx, a hand-made graph) lacks, instead of a ``KeyError`` deep in the
planner. The table in ``docs/architecture.md`` explains each field.

Example::

    >>> import networkx as nx
    >>> from lynx.planner.graph_schema import check_graph
    >>> check_graph(nx.DiGraph())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: the graph to plan lacks graph attribute(s) ['blocks', ...] ...
"""

from __future__ import annotations

from typing import Literal, Optional, TypedDict

import networkx as nx

from lynx.errors import LynxConfigError

__all__ = ["NodeAttrs", "Block", "GraphAttrs", "NODE_KEYS", "GRAPH_KEYS", "check_graph"]


class NodeAttrs(TypedDict):
    """One op node (its fx node name is the networkx node)."""

    op: str  # aten op, e.g. "aten.linear.default"
    flops: int  # forward FLOPs per microbatch
    output_bytes: int  # bytes of its outputs per microbatch
    saved_bytes: int  # bytes autograd saves for backward attributed to it (de-duplicated)
    output_saved: bool  # its output storage is among the saved tensors
    forward_s: float  # cost model times (0.0 until annotated)
    backward_s: float
    block: int  # index into GraphAttrs["blocks"]
    layer: Optional[int]  # repeated layer index, None in edge blocks
    layer_class: str  # shared by structurally identical layers; "pre"/"post" for edges
    module_path: str  # innermost module, e.g. "layers.3.attn.qkv"
    core_attention: bool  # QKᵀ, softmax, attention dropout, ·V or a fused sdpa


class Block(TypedDict):
    """A run of nodes: the ``pre`` edge block, one repeated layer, or the ``post`` edge block."""

    index: int
    name: str
    kind: Literal["edge", "layer"]
    layer_class: str
    layer: Optional[int]
    module_path: str
    nodes: list[str]  # in forward topological order
    param_bytes: int


class GraphAttrs(TypedDict):
    blocks: list[Block]
    layer_classes: dict[str, list[int]]  # class id -> layer indices
    target: Literal["cuda", "cpu"]
    dims: dict[str, object]  # hidden, heads, layers, seq, microbatch, dtype (may be None)
    param_bytes: list[int]  # per block, aligned with blocks


# what the planner needs; the frontend writes more (input_bytes, is_view, output_shapes, ...)
NODE_KEYS = ("op", "flops", "output_bytes", "saved_bytes", "output_saved", "block", "layer")
GRAPH_KEYS = ("blocks", "layer_classes", "param_bytes")


def check_graph(graph: nx.DiGraph) -> None:
    """Raise :class:`~lynx.errors.LynxConfigError` naming what the graph lacks."""
    fix = "build it with lynx.frontend.graph.build_graph or lynx.analyze"
    missing = [k for k in GRAPH_KEYS if k not in graph.graph]
    if missing:
        raise LynxConfigError(
            f"the graph to plan lacks graph attribute(s) {missing} (see lynx.planner.graph_schema.GraphAttrs); {fix}"
        )
    for name, attrs in graph.nodes(data=True):
        lacking = [k for k in NODE_KEYS if k not in attrs]
        if lacking:
            raise LynxConfigError(
                f"graph node {name!r} lacks attribute(s) {lacking} (see lynx.planner.graph_schema.NodeAttrs); {fix}"
            )
    known = set(graph.nodes)
    for block in graph.graph["blocks"]:
        unknown = [n for n in block.get("nodes", ()) if n not in known]
        if unknown:
            raise LynxConfigError(
                f"block {block.get('name', block.get('index'))!r} lists nodes that are not "
                f"in the graph: {unknown[:3]}; {fix}"
            )
