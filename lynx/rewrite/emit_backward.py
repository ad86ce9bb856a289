"""The backward graph of a lowered stage (the emission :mod:`lynx.rewrite.emit` leaves to this module).

:func:`build_backward` copies the joint graph's backward nodes in order, each dropped value not
brought back beforehand recomputed just before its first reader (timed by a
:class:`~lynx.rewrite.graph_calls.Clock`), parameter gradients optionally handed to a
:class:`~lynx.rewrite.graph_calls.GradSink` as soon as they are final, a TP window's share
recomputed between its all-reduce and the wait (:mod:`lynx.rewrite.tp_windows`), offloaded
values brought back where the plan says. For zero-bubble schedules the same nodes split in
two (:func:`split_backward_nodes`): ``part="input"`` emits those the input gradients need and
returns, after the gradients, the values the rest reads; ``part="weight"`` emits the rest.

Example::

    >>> import torch
    >>> from lynx.frontend.joint import trace_joint
    >>> from lynx.rewrite.lower import lower
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> lowered = lower(trace_joint(gm, [torch.randn(2, 4)]), dropped={"relu"})
    >>> graph = lowered.backward_graph(frozenset(), sink=False)
    >>> sorted(graph.nodes)
    ['relu']
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import fx

from lynx.frontend.joint import JointGraph, fetch_attr, storage_nbytes, storage_root
from lynx.rewrite.emit import BackwardGraph, ancestors, compiled, copy_node, copy_placeholder, rng_slots
from lynx.rewrite.fast_calls import bind_calls
from lynx.rewrite.graph_calls import Clock, GradSink, accumulate_grad, clock_start, clock_stop
from lynx.rewrite.inplace import accumulate_in_place
from lynx.rewrite.liveness import extra_peak_bytes
from lynx.rewrite.offload import offload_issue, offload_wait
from lynx.rewrite.tp_windows import (TPWindowLog, backward_allreduces, tp_segment_start, tp_segment_stop,
                                     tp_wait_start, tp_wait_stop)
from lynx.torch_private import boxed_codegen

if TYPE_CHECKING:
    from lynx.rewrite.lower import LoweredStage

__all__ = ["build_backward", "split_backward_nodes"]


def split_backward_nodes(lowered: LoweredStage) -> tuple[set[fx.Node], set[fx.Node]]:
    """The joint graph's backward nodes the input gradients need, and the rest (what only the
    weight gradients need)."""
    forward, n_attrs = lowered.forward_nodes, len(lowered.joint.attr_names)
    backward = {n for n in lowered.joint.gm.graph.nodes if n not in forward and n.op not in ("placeholder", "output")}
    to_inputs = [g for k, g in enumerate(lowered.grads) if lowered.grad_of[k] >= n_attrs and isinstance(g, fx.Node)]
    to_weights = [g for k, g in enumerate(lowered.grads) if lowered.grad_of[k] < n_attrs and isinstance(g, fx.Node)]
    inputs = ancestors(to_inputs, stop=forward) & backward
    return inputs, (ancestors(to_weights, stop=forward) & backward) - inputs


def _backward_sequence(lowered: LoweredStage, sources: set[fx.Node],
                       windows: dict[fx.Node, list[fx.Node]] | None = None, only: set[fx.Node] | None = None,
                       ) -> tuple[list[tuple[str, fx.Node]], set[fx.Node]]:
    """The backward nodes in order (``"bw"``; those in ``only`` when given), each forward value
    they read that is not a source recomputed just before (``"re"``), and the set of those
    recomputed. ``windows``: after a collective, recompute these values (``"tp"``: inside its
    window, before its wait)."""
    forward = lowered.forward_nodes
    recomputed: set[fx.Node] = set()
    sequence: list[tuple[str, fx.Node]] = []

    def ensure(n: fx.Node, kind: str = "re") -> None:
        stack = [(n, False)]
        while stack:
            node, expanded = stack.pop()
            if node in sources or node in recomputed or node not in forward:
                continue
            if expanded:
                recomputed.add(node)
                sequence.append((kind, node))
                continue
            if node.op == "placeholder":
                raise AssertionError(f"lowering: backward needs primal {node.name} that the forward did not keep")
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.all_input_nodes))

    for b in lowered.joint.gm.graph.nodes:
        if b in forward or b.op in ("placeholder", "output") or (only is not None and b not in only):
            continue
        for a in b.all_input_nodes:
            ensure(a)
        sequence.append(("bw", b))
        for target in (windows or {}).get(b, ()):
            ensure(target, "tp")
    return sequence, recomputed


def build_backward(lowered: LoweredStage, available: frozenset[int], sink: bool,
                   tp_windows: tuple[tuple[int, frozenset[int]], ...] = (), part: str = "all",
                   cross: list[str] | None = None, streamed: Mapping[int, str | None] | None = None
                   ) -> BackwardGraph:
    """Joint backward nodes in order, each dropped value recomputed just before its first reader.

    ``tp_windows``: ``(k, slots)`` recomputed right after the backward's k-th collective, before
    its wait (:mod:`lynx.rewrite.tp_windows`). ``part``: ``"all"``; ``"input"`` (the input
    gradients, then the cross values); ``"weight"`` (the weight gradients, all into the sink,
    from the ``cross`` values the input part returned).

    ``streamed``: kept slots that are on the host when the backward starts (offloaded), each
    with the captured node whose backward issues its prefetch (None: the graph's start); the
    graph issues each such group there (:func:`~lynx.rewrite.offload.offload_issue`) and waits
    for it before its first reader (:func:`~lynx.rewrite.offload.offload_wait`). Under a split
    the part that reads a value first brings it back (the input part hands it on as a cross
    value when the weight part reads it too).
    """
    nodes = lowered.graph_nodes
    slot_names = lowered.slot_names
    n_kept, n_held = len(lowered.kept), len(lowered.held)
    streamed = dict(streamed or {})
    kept_slots = [i for i in range(n_kept) if i not in streamed]
    avail_slots = sorted(available)
    sources = {nodes[slot_names[i]]: i for i in kept_slots + avail_slots + list(range(n_kept, n_kept + n_held))}
    crossed = [nodes[name] for name in cross or ()]
    only = None
    if part != "all":
        inputs, weights = split_backward_nodes(lowered)
        only = inputs if part == "input" else weights
    fetched = {nodes[slot_names[i]]: i for i in streamed if nodes[slot_names[i]] not in crossed}
    rng_slot = rng_slots(lowered)
    windows: dict[fx.Node, list[fx.Node]] = {}
    if tp_windows:
        collectives = backward_allreduces(lowered.joint.gm, lowered.forward_nodes)
        for k, slots in tp_windows:
            windows[collectives[k]] = [nodes[slot_names[i]] for i in sorted(slots)]
    sequence, recomputed = _backward_sequence(lowered, set(sources) | set(crossed) | set(fetched), windows, only)
    # only what this graph reads comes back in it (under a split, the other part brings the rest)
    read_here = {a for _kind, n in sequence for a in n.all_input_nodes}
    fetched = {n: i for n, i in fetched.items() if n in read_here}
    streamed = {i: streamed[i] for i in fetched.values()}
    slot_joint = {i: n for n, i in fetched.items()}
    in_window = {n for kind, n in sequence if kind == "tp"}
    waits = {u for c in windows for u in c.users if "wait_tensor" in str(u.target)}
    held_used = [i for i in range(n_kept, n_kept + n_held)
                 if any(u in recomputed for u in nodes[slot_names[i]].users)]
    rng_used = [(rng_slot[n], n) for n in lowered.joint.gm.graph.nodes if n in recomputed and n in rng_slot]
    read = {a for _kind, n in sequence for a in n.all_input_nodes}
    if part == "weight":   # only the slots it reads: the rest is freed after the input part
        kept_slots = [i for i in kept_slots if nodes[slot_names[i]] in read]
        avail_slots = [i for i in avail_slots if nodes[slot_names[i]] in read]
    in_slots = kept_slots + avail_slots + held_used

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    prefetch = _Prefetch(graph, streamed, lowered.joint, lowered.forward_nodes) if streamed else None
    for i in in_slots:
        copy_placeholder(graph, nodes[slot_names[i]], env)
    state_of = {n: graph.placeholder(f"rng_state_{n.name}") for _i, n in rng_used}
    for t in (lowered.tangents if part != "weight" else crossed):
        copy_placeholder(graph, t, env)
    clock = graph.get_attr("lynx_clock") if recomputed else None
    n_attrs = len(lowered.joint.attr_names)
    # the gradients this graph computes (all of them but in a split); the weight part sinks all
    mine = set(range(len(lowered.grads)))
    if only is not None:
        passed = set(lowered.tangents) if part == "input" else set()
        mine = {k for k, g in enumerate(lowered.grads) if g in only or g in passed}
    # parameter gradients handed over as soon as computed: index in grads -> attribute index
    sunk = {k: i for k, i in enumerate(lowered.grad_of)
            if k in mine and i < n_attrs and (sink or part == "weight")}
    sink_node = graph.get_attr("lynx_sink") if sunk else None
    sink_after: dict[fx.Node, list[tuple[int, int]]] = {}
    for k, i in sunk.items():
        sink_after.setdefault(lowered.grads[k], []).append((k, i))
    tp_log = graph.get_attr("lynx_tp_log") if windows else None
    in_recompute = in_tp = False
    if prefetch is not None:
        prefetch.reach(None)
    for kind, n in sequence:
        if prefetch is not None:
            if kind == "bw":
                prefetch.reach(lowered.joint.origin.get(n.name))
            for a in n.all_input_nodes:
                if a in fetched and a not in env:
                    prefetch.take(fetched[a], slot_joint, env)
        if (kind == "re") != in_recompute:
            in_recompute = kind == "re"
            graph.call_function(clock_start if in_recompute else clock_stop, (clock,))
        if (kind == "tp") != in_tp:
            in_tp = kind == "tp"
            graph.call_function(tp_segment_start if in_tp else tp_segment_stop, (tp_log,))
        if n in waits:  # how long the wait after a window blocked: was the collective still in flight?
            graph.call_function(tp_wait_start, (tp_log,))
            copy_node(graph, n, env, state_of)
            graph.call_function(tp_wait_stop, (tp_log,))
        else:
            copy_node(graph, n, env, state_of)
        for _k, i in sink_after.pop(n, ()):
            graph.call_function(accumulate_grad, (sink_node, i, env[n]))
    if in_recompute:
        graph.call_function(clock_stop, (clock,))
    if in_tp:
        graph.call_function(tp_segment_stop, (tp_log,))
    for g, pairs in sink_after.items():  # gradients that are inputs (a tangent passed through)
        for _k, i in pairs:
            graph.call_function(accumulate_grad, (sink_node, i, env[g]))
    outputs: list[Any] = [None if k in sunk or k not in mine else env[g] for k, g in enumerate(lowered.grads)]
    handed: list[fx.Node] = []
    if part == "input":   # what the weight part reads that only this part has
        _inputs, weights = split_backward_nodes(lowered)
        wanted = {a for w in weights for a in w.all_input_nodes if a not in weights and a in env and a not in sources}
        handed = [n for n in lowered.joint.gm.graph.nodes if n in wanted]
        outputs += [env[n] for n in handed]
    graph.output(tuple(outputs) if part != "weight" else ())
    if not lowered.compile:
        graph.set_codegen(boxed_codegen())
    attrs: dict[str, Any] = {"lynx_clock": Clock(), "lynx_sink": GradSink(), "lynx_tp_log": TPWindowLog()}
    for n in graph.nodes:
        if n.op == "get_attr" and n.target not in attrs:
            attrs[n.target] = fetch_attr(lowered.joint.gm, n.target)
    gm = fx.GraphModule(attrs, graph)
    extra = extra_peak_bytes(graph, {v: k for k, v in env.items()}, lowered.stage_roots)
    # gradient sums into a dying operand, as autograd's engine does them (Inductor does its own);
    # after the peak above: what the plan models is the joint graph's out-of-place sums, which
    # this only lowers
    if not lowered.compile and accumulate_in_place(graph):
        gm.recompile()
    origins = frozenset(lowered.origin[n.name] for n in recomputed - in_window if n.name in lowered.origin)
    tp_origins = frozenset(lowered.origin[n.name] for n in in_window if n.name in lowered.origin)
    run: Callable[[list], Any]
    if lowered.compile:
        fn = compiled(gm, True)
        run = lambda args: fn(*args)  # noqa: E731 - Inductor manages its buffers itself
    else:
        run = bind_calls(gm)
    roots = {storage_root(n) for n in handed} & lowered.stage_roots
    return BackwardGraph(gm=gm, run=run, in_slots=in_slots + [i for i, _ in rng_used], nodes=origins,
                         clock=attrs["lynx_clock"], extra_peak_bytes=extra,
                         sink=attrs["lynx_sink"] if sunk else None, tp_log=attrs["lynx_tp_log"],
                         tp_nodes=tp_origins, cross=[n.name for n in handed],
                         cross_bytes=sum(storage_nbytes(r) for r in roots),
                         offload_groups=prefetch.groups if prefetch is not None else ())


class _Prefetch:
    """Where a backward graph brings offloaded slots back: one group per issuing node, issued
    when the backward reaches that node — its first node from that captured node or one before
    it in forward order (a node whose backward has no op of its own is passed, not met) — or at
    the start; waited on before the group's first reader (issued there, if the reader comes first)."""

    def __init__(self, graph: fx.Graph, streamed: Mapping[int, str | None], joint: JointGraph,
                 forward: set[fx.Node]) -> None:
        self.graph = graph
        self.handle = graph.placeholder("lynx_offload")   # the microbatch's OffloadedValues
        self.position: dict[str, int] = {}   # captured node -> its place in the forward
        for n in joint.gm.graph.nodes:
            if n in forward and n.name in joint.origin:
                self.position.setdefault(joint.origin[n.name], len(self.position))
        by_issue: dict[str | None, list[int]] = {}
        for slot, at in sorted(streamed.items(), key=lambda kv: kv[0]):
            by_issue.setdefault(at if at in self.position else None, []).append(slot)
        self.order = list(by_issue)   # group id -> issuing node
        self.groups = tuple(tuple(by_issue[at]) for at in self.order)
        self.group_of = {slot: g for g, slots in enumerate(self.groups) for slot in slots}
        self.issued: dict[int, fx.Node] = {}
        self.waited: set[int] = set()

    def reach(self, origin: str | None) -> None:
        """The backward reaches captured node ``origin`` (None: the start): issue the groups whose
        issuing node it is, or is not before."""
        here = self.position.get(origin) if origin is not None else None
        for g, at in enumerate(self.order):
            if g in self.issued:
                continue
            if at is None or (here is not None and here <= self.position[at]):
                self.issued[g] = self.graph.call_function(offload_issue, (self.handle, g))

    def take(self, slot: int, joint_of: Mapping[int, fx.Node], env: dict[fx.Node, fx.Node]) -> None:
        """Make ``slot``'s value available to its first reader: the group waited on, and every
        value of it taken from the issue's result at once (the result would hold them all until
        its last piece is taken), each then freed after its own last reader."""
        g = self.group_of[slot]
        if g not in self.issued:   # its reader came before the node that issues it
            self.issued[g] = self.graph.call_function(offload_issue, (self.handle, g))
        if g in self.waited:
            return
        self.graph.call_function(offload_wait, (self.handle, g))
        self.waited.add(g)
        for k, member in enumerate(self.groups[g]):
            joint = joint_of[member]
            value = self.graph.call_function(operator.getitem, (self.issued[g], k))
            value.meta = dict(joint.meta)
            env[joint] = value


