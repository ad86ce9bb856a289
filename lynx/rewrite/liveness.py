"""How far the storages a generated graph holds rise above its inputs', from their live ranges.

A backward graph brings values back (on-demand recompute) and makes gradients; the plan's
memory model needs the peak of the *counted* storages (activations the profile attributes to
the stage) inside it, beyond what its inputs already hold: the ``extra_peak_bytes`` of a
:class:`lynx.rewrite.emit.BackwardGraph`.

Example::

    >>> import torch
    >>> from torch import fx
    >>> joint = fx.Graph()
    >>> x = joint.placeholder("x"); x.meta["val"] = torch.empty(4)
    >>> y = joint.call_function(torch.neg, (x,)); y.meta["val"] = torch.empty(4)
    >>> z = joint.call_function(torch.exp, (y,)); z.meta["val"] = torch.empty(4)
    >>> _ = joint.output((z,))
    >>> extra_peak_bytes(joint, {n: n for n in joint.nodes}, counted={y, z})  # y and z both live at exp
    32
"""

from __future__ import annotations

import operator

from torch import fx

from lynx.frontend.joint import storage_nbytes, storage_root

__all__ = ["extra_peak_bytes"]


def extra_peak_bytes(graph: fx.Graph, joint_of: dict[fx.Node, fx.Node], counted: set[fx.Node]) -> int:
    """How far the counted storages live in ``graph`` rise above what its inputs hold.

    ``joint_of`` maps each of ``graph``'s nodes to the joint-graph node it copies; a storage
    counts when its root (:func:`~lynx.frontend.joint.storage_root`) is in ``counted``.

    A storage lives from the first node that holds it (an input or a recomputed value) until
    the last use of any node aliasing it: fx's generated code drops each value after its last
    use, and the boxed calling convention lets inputs go too. A piece of a multi-output op's
    result (``getitem``, e.g. dropout's mask or layer norm's statistics) lives from the op
    until the last use of the piece or of the op's result, whichever is later: the result
    holds every piece until its last piece is taken.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    start: dict[fx.Node, int] = {}
    end: dict[fx.Node, int] = {}
    for n in graph.nodes:
        j = joint_of.get(n)
        if j is None:
            continue
        root = storage_root(j)
        if root not in counted:
            continue
        first = 0 if n.op == "placeholder" else order[n]
        last = max((order[u] for u in n.users), default=first)
        whole = n.args[0] if n.target is operator.getitem and n.args else None
        if isinstance(whole, fx.Node) and whole.op != "placeholder":
            first = min(first, order[whole])
            last = max([last] + [order[u] for u in whole.users])
        start[root] = min(start.get(root, first), first)
        end[root] = max(end.get(root, last), last)
    events: dict[int, int] = {}
    initial = 0
    for root, t0 in start.items():
        size = storage_nbytes(root)
        if t0 == 0:
            initial += size
        else:
            events[t0] = events.get(t0, 0) + size
        events[end[root] + 1] = events.get(end[root] + 1, 0) - size
    live = peak = initial
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak - initial
