"""Which part of a split backward reads each saved value: zero bubble's input- or weight-gradient part.

A zero-bubble stage splits its backward (:func:`lynx.rewrite.emit_backward.split_backward_nodes`): the
input-gradient part ``I`` is every backward node the gradients of the stage's inputs need, the
weight-gradient part ``W`` the rest, run later. In the whole model's joint graph a backward
node ``u`` serves the input gradients of a stage that starts at captured node ``k`` exactly
when its result flows into the backward of a node before ``k`` (through the stage's inputs):
so each reader of a saved value gets a *reach*, the earliest captured node (forward order)
whose backward it flows into, and in a stage starting at ``k`` it belongs to ``I`` iff its
reach is before ``k``. A stage that starts the model sends no input gradient: all of it is
``W``.

:func:`backward_reach` gives, per captured node owning saved values, the earliest and the
latest reach among the readers of its saved output and among the readers of the rest of what
it saves (a reach of ``None``: the readers flow into no captured node's backward, only into weight
gradients; ``""``: into a model input's gradient, before every node). What the planner derives from it:
:func:`lynx.solvers.memory_weights.weight_held_bytes`.

Example::

    >>> import torch
    >>> from lynx.frontend.joint import trace_joint
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4)),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> joint = trace_joint(gm, [torch.randn(2, 4, requires_grad=True)])
    >>> reach = backward_reach(joint, {n.name: i for i, n in enumerate(gm.graph.nodes)})
    >>> reach["gelu"]["output"]   # the second linear reads it for its weight gradient only
    ('linear_1', 'linear_1')
    >>> reach["linear"]["output"]  # GELU's backward: on the way to the input's gradient
    ('', '')
"""

from __future__ import annotations

from typing import Optional

from torch import fx

from lynx.frontend.joint import JointGraph, classify, input_saver, storage_root

__all__ = ["backward_reach"]

Reach = tuple[Optional[str], Optional[str]]


def backward_reach(joint: JointGraph, order: dict[str, int]) -> dict[str, dict[str, Reach]]:
    """Per owner of saved values: ``{"output": (earliest, latest), "rest": (earliest, latest)}``
    reach of the backward nodes reading them (see the module docstring); a part nobody reads is
    absent."""
    parts = classify(joint)
    forward, origin = parts.forward, joint.origin
    attrs = set(parts.primals[:len(joint.attr_names)])
    never = len(order) + 1
    name_at = {i: name for name, i in order.items()}
    name_at[-1] = ""   # before every node: a model input's gradient
    n_attrs = len(joint.attr_names)
    to_inputs = {g for k, g in enumerate(parts.grads) if k >= n_attrs and isinstance(g, fx.Node)}
    reach: dict[fx.Node, int] = {}
    for n in reversed(parts.nodes):   # users before producers
        if n in forward or n.op in ("placeholder", "output"):
            continue
        here = -1 if n in to_inputs else order.get(origin.get(n.name, ""), never)
        reach[n] = min([here] + [reach[u] for u in n.users if u in reach])
    out_roots: dict[str, set[fx.Node]] = {}
    for m in parts.nodes:
        name = origin.get(m.name)
        if m in forward and name and (m in parts.fw_outs or any(
                u in forward and origin.get(u.name) not in (None, name) for u in m.users)):
            out_roots.setdefault(name, set()).add(storage_root(m))
    readers: dict[fx.Node, list[int]] = {}
    for n in parts.saved:
        readers.setdefault(storage_root(n), []).extend(reach[u] for u in n.users if u in reach)
    result: dict[str, dict[str, list[int]]] = {}
    for root, seen in readers.items():
        if root.op == "placeholder":
            name = None if root in attrs else input_saver(joint, root, forward)
        else:
            name = parts.owner.get(root)
        if name is None or not seen:
            continue
        part = "output" if root in out_roots.get(name, ()) else "rest"
        result.setdefault(name, {}).setdefault(part, []).extend(seen)
    return {name: {part: (name_at.get(min(r)), name_at.get(max(r))) for part, r in by_part.items()}
            for name, by_part in result.items()}
