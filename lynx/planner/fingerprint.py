"""The graph fingerprint a plan is checked against: what the plan's numbers depend on.

Example::

    >>> import networkx as nx
    >>> from lynx.planner.fingerprint import graph_fingerprint
    >>> g = nx.DiGraph(); g.add_node("mm", op="aten.mm.default", flops=8, saved_bytes=4)
    >>> len(graph_fingerprint(g)), graph_fingerprint(g) == graph_fingerprint(g.copy())
    (16, True)
"""

from __future__ import annotations

import hashlib
import json

import networkx as nx

__all__ = ["graph_fingerprint"]


def graph_fingerprint(graph: nx.DiGraph) -> str:
    """Hash of the graph's structure and profile numbers (what a plan depends on)."""
    digest = hashlib.sha256()
    keys = ("op", "flops", "output_bytes", "saved_bytes", "output_saved", "block", "layer", "core_attention")
    for name in sorted(graph.nodes):
        attrs = graph.nodes[name]
        record = [name] + [attrs.get(k) for k in keys]
        record += [round(float(attrs.get("forward_s", 0.0)), 12), round(float(attrs.get("backward_s", 0.0)), 12)]
        record.append(sorted(graph.successors(name)))
        digest.update(json.dumps(record, default=str).encode())
    digest.update(json.dumps([graph.graph.get("param_bytes"), graph.graph.get("target")], default=str).encode())
    return digest.hexdigest()[:16]
