"""Partition a stage's joint graph along its plan: forward, per-window recompute and backward graphs.

The partition follows ``torch._functorch.partitioners.default_partition``: the forward nodes
are the joint graph's nodes up to its last forward node, and the *saved* values are the
forward values a backward node reads. Each saved value belongs to the captured node that
produced its storage (a view belongs to its base's producer; a dropout mask to the dropout),
the profile's rule. Saved values of nodes the plan drops are *dropped*; the rest are *kept*.

* **forward** (``primals`` → stage outputs, kept values, *held* values, RNG states): the
  held values are the inputs of the dropped region that are not themselves dropped (kept
  values and primals need no holding). Before every random op the dropped region contains,
  the forward graph saves the RNG state of its device.
* **recompute** (kept + held + RNG states + already recomputed values → dropped values): one
  graph per set of targets, built on first use and cached, so a window's recomputation and
  the on-demand rest each run as one generated function. Random ops replay their saved state
  (:func:`~lynx.rewrite.graph_calls.replay_rng`), so dropout draws the same mask bitwise.
* **backward** (kept + dropped values + tangents → gradients of the primals that need one).

All three are ``fx.GraphModule`` s: generated Python, one call per graph. The backward graph
uses fx's boxed calling convention (it clears its argument list), so each value is freed after
its last use inside the graph. This module is the partition and the slot table; the graphs are
written by :mod:`lynx.rewrite.emit`, call :mod:`lynx.rewrite.graph_calls`, and their memory
peaks come from :mod:`lynx.rewrite.liveness`.

Example::

    >>> import torch
    >>> from lynx.frontend.joint import trace_joint
    >>> from lynx.rewrite.split import split_graph
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> part = split_graph(gm, [[n.name for n in gm.graph.nodes if n.op == "call_function"]])[0]
    >>> lowered = lower(trace_joint(part.gm, [torch.randn(2, 4)]), dropped={"linear"})
    >>> [lowered.origin[name] for name in lowered.dropped_values]
    ['linear']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from lynx.frontend.joint import JointGraph, classify, input_saver, storage_nbytes, storage_root
from lynx.frontend.joint_tp import is_collective
from lynx.rewrite.emit import BackwardGraph, RecomputeGraph, build_forward, build_recompute, compiled
from lynx.rewrite.emit_backward import build_backward
from lynx.torch_private import is_op_overload

__all__ = ["LoweredStage", "lower"]

# random ops whose overload carries no ``nondeterministic_seeded`` tag
_RANDOM_NAMES = ("dropout", "bernoulli", "rand", "rrelu", "multinomial")


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if is_op_overload(target):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return True
        return any(k in target.name() for k in _RANDOM_NAMES)
    return False


@dataclass
class LoweredStage:
    """A stage's generated graphs and the slot table that connects them (see module docstring).

    A microbatch's values live in a list indexed by slot: ``[kept..., held..., rng states...,
    dropped...]``; the forward graph fills all but the dropped slots, recompute graphs fill
    those, the backward graph reads kept and dropped slots.
    """

    joint: JointGraph
    forward: fx.GraphModule
    run_forward: Callable[..., Any]  # the forward graph, or its torch.compile'd form
    compile: bool
    kept: list[str]
    held: list[str]
    rng: list[str]                 # random joint nodes whose state the forward saves
    dropped_values: list[str]
    grad_of: list[int]             # primal index of each backward output
    origin: dict[str, str]
    dropped_by_node: dict[str, list[int]]  # captured node -> its dropped slots
    bytes_of_slot: list[int]       # storage bytes each slot brings (0: shared or not activation)
    send_bytes: int                # storages of the stage's outputs not among the kept ones
    category_of_slot: list[str]    # "stage", "held" or "boundary"
    stage_roots: set[fx.Node] = field(repr=False)   # storages the plan counts
    # the joint graph as the emitters read it
    graph_nodes: dict[str, fx.Node] = field(repr=False)   # joint node by name
    forward_nodes: set[fx.Node] = field(repr=False)       # the joint graph's forward nodes
    tangents: list[fx.Node] = field(repr=False)           # its tangent placeholders
    grads: list[fx.Node] = field(repr=False)              # the gradient of each primal in grad_of
    # kept slots the forward graph hands to the host (offload), each with its captured node
    offload_slots: dict[int, str] = field(default_factory=dict)
    _recompute: dict[tuple[frozenset[int], frozenset[int]], RecomputeGraph] = field(repr=False, default_factory=dict)
    _backward: dict[tuple, BackwardGraph] = field(repr=False, default_factory=dict)
    _split: dict[tuple, tuple[BackwardGraph, BackwardGraph]] = field(repr=False, default_factory=dict)

    @property
    def n_slots(self) -> int:
        return len(self.kept) + len(self.held) + len(self.rng) + len(self.dropped_values)

    @property
    def first_dropped_slot(self) -> int:
        return len(self.kept) + len(self.held) + len(self.rng)

    @property
    def slot_names(self) -> list[str]:
        """The joint node (or RNG state) behind each slot, in slot order."""
        return self.kept + self.held + self.rng + self.dropped_values

    def recompute_graph(self, targets: frozenset[int], available: frozenset[int]) -> RecomputeGraph:
        """The graph bringing back dropped ``targets`` given the dropped slots already ``available``."""
        key = (targets, available)
        graph = self._recompute.get(key)
        if graph is None:
            graph = self._recompute[key] = build_recompute(self, targets, available)
        return graph

    def backward_graphs(self) -> list[BackwardGraph]:
        """The backward graphs built so far, one per (prefetched slots, sink, TP windows)."""
        return list(self._backward.values())

    def backward_graph(self, available: frozenset[int], sink: bool = False,
                       tp_windows: tuple[tuple[int, frozenset[int]], ...] = (),
                       streamed: frozenset[tuple[int, str | None]] = frozenset()) -> BackwardGraph:
        """The backward graph when the dropped slots ``available`` were brought back beforehand.

        With ``sink`` the graph hands each parameter's gradient to ``graph.sink`` as soon as it
        is final (:func:`~lynx.rewrite.graph_calls.accumulate_grad`) instead of returning it.
        ``tp_windows`` (:func:`lynx.rewrite.tp_windows.window_targets`): dropped slots
        recomputed between a backward collective and its wait. ``streamed``: ``(kept slot,
        issuing node)`` of the offloaded values the graph brings back itself
        (:func:`~lynx.rewrite.emit_backward.build_backward`).
        """
        key = (available, sink, tp_windows, streamed)
        graph = self._backward.get(key)
        if graph is None:
            graph = self._backward[key] = build_backward(self, available, sink, tp_windows, streamed=dict(streamed))
        return graph

    def split_backward_graphs(self, available: frozenset[int], sink: bool = False,
                              streamed: frozenset[tuple[int, str | None]] = frozenset()
                              ) -> tuple[BackwardGraph, BackwardGraph]:
        """Zero bubble: the input-gradient graph (gradients, then the values the other reads)
        and the weight-gradient graph, from the same joint graph, for prefetched ``available``
        (``streamed`` offloaded values: brought back by the part that reads them first)."""
        key = (available, sink, streamed)
        graphs = self._split.get(key)
        if graphs is None:
            first = build_backward(self, available, sink, part="input", streamed=dict(streamed))
            graphs = self._split[key] = (first, build_backward(self, available, True, part="weight",
                                                               cross=first.cross, streamed=dict(streamed)))
        return graphs


def lower(joint: JointGraph, dropped: Iterable[str], *, compile: bool = False, model_inputs: int = 0,
          offload: Iterable[str] = ()) -> LoweredStage:
    """Partition ``joint`` so that the saved values of the ``dropped`` captured nodes are recomputed.

    The stage's first ``model_inputs`` inputs are model inputs (the rest are received): a saved
    model input counts, as in the profile, on the node that saved it while that node is kept.
    The kept values of the ``offload`` captured nodes (those in storages the stage owns) go to
    host memory as the forward graph computes them (``LoweredStage.offload_slots``).

    With ``compile`` every generated graph is passed through ``torch.compile`` (Inductor).
    """
    dropped = frozenset(dropped)
    parts = classify(joint)
    nodes, primals, fw_outs, grads, forward, owner, saved = (parts.nodes, parts.primals, parts.fw_outs, parts.grads,
                                                             parts.forward, parts.owner, parts.saved)
    # a collective is never recomputed (a rank re-issuing it alone would hang its group):
    # its result is held from the forward where a dropped value needs it
    is_dropped = {n: owner.get(n) in dropped and not is_collective(n) for n in forward}
    dropped_values = [n for n in saved if is_dropped[n]]
    kept = [n for n in saved if not is_dropped[n]]
    kept_set = set(kept)
    # the dropped region: what recomputing every dropped value runs; its other inputs are held
    region, held, stack = set(), [], list(dropped_values)
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in n.all_input_nodes:
            if a in region:
                continue
            if a.op != "placeholder" and is_dropped.get(a, False):
                stack.append(a)
            elif a not in kept_set and a not in held:
                held.append(a)
    order = {n: i for i, n in enumerate(nodes)}
    held.sort(key=order.__getitem__)
    rng_nodes = sorted((n for n in region if _is_random(n)), key=order.__getitem__)

    rng_names = [f"rng_state:{n.name}" for n in rng_nodes]   # (as build_forward names them)
    grad_of = [i for i, g in enumerate(grads) if g is not None]

    slots = [n.name for n in kept + held] + rng_names + [n.name for n in dropped_values]
    slot_of = {name: i for i, name in enumerate(slots)}
    dropped_by_node: dict[str, list[int]] = {}
    for n in dropped_values:
        name = owner[n]
        assert name is not None, n  # dropped: owned by a captured node the plan names
        dropped_by_node.setdefault(name, []).append(slot_of[n.name])
    n_attrs = len(joint.attr_names)

    def input_category(root: fx.Node) -> str:
        if primals.index(root) - n_attrs >= model_inputs:
            return "boundary"  # received: the sender's
        return "held" if input_saver(joint, root, forward) in dropped else "stage"

    sizes, categories = _slot_bytes(kept + held, rng_names, dropped_values, primals, n_attrs, input_category,
                                    held_set=set(held))
    kept_roots = {storage_root(n) for n in kept + held}
    out_roots = {storage_root(n) for n in fw_outs} - kept_roots
    send_bytes = sum(storage_nbytes(r) for r in out_roots if r.op != "placeholder")
    # storages the meter counts under "stage": saved values the stage produced, and saved model
    # inputs while the node that saved them is kept (the profile counts them on that node)
    stage_roots = {r for r in (storage_root(n) for n in kept + dropped_values) if r.op != "placeholder"}
    stage_roots |= {storage_root(n) for n, category in zip(kept, categories)
                    if category == "stage" and storage_root(n).op == "placeholder"}
    # what the stage sends is held by the caller until the backward ends (its roots): a kept
    # one is not freed inside the backward graph (a dropped one is recomputed: a new copy)
    stage_roots -= {storage_root(n) for n in fw_outs} & kept_roots
    offloaded = _offloaded(kept, owner, frozenset(offload), stage_roots)
    fw_gm, _ = build_forward(joint, primals, fw_outs, kept + held, rng_nodes,
                             offloaded={kept[i]: key for i, key in offloaded.items()})
    return LoweredStage(joint=joint, forward=fw_gm, run_forward=compiled(fw_gm, compile), compile=compile,
                        kept=[n.name for n in kept], held=[n.name for n in held], rng=rng_names,
                        dropped_values=[n.name for n in dropped_values], grad_of=grad_of,
                        origin={n.name: o for n, o in owner.items() if o}, dropped_by_node=dropped_by_node,
                        bytes_of_slot=sizes, send_bytes=send_bytes, category_of_slot=categories,
                        stage_roots=stage_roots, graph_nodes={n.name: n for n in nodes}, forward_nodes=forward,
                        tangents=parts.tangents, grads=[g for g in grads if g is not None],
                        offload_slots={i: str(owner[kept[i]]) for i in offloaded})


def _offloaded(kept: list[fx.Node], owner: dict[fx.Node, str | None], offload: frozenset[str],
               stage_roots: set[fx.Node]) -> dict[int, tuple[int, int]]:
    """Kept slots the forward hands to the host, each with the index of its storage: values of
    offloaded nodes in storages the stage owns (not a model input, a received value or what it
    sends), dense tensors copied byte for byte."""
    storages: dict[fx.Node, int] = {}
    out = {}
    for i, n in enumerate(kept):
        root = storage_root(n)
        val = n.meta.get("val")
        if owner.get(n) in offload and root in stage_roots and isinstance(val, torch.Tensor) \
                and val.layout == torch.strided and not val.is_quantized:
            out[i] = (i, storages.setdefault(root, len(storages)))
    return out


def _slot_bytes(fw_saved: list[fx.Node], rng_names: list[str], dropped_values: list[fx.Node], primals: list[fx.Node],
                n_attrs: int, input_category: Callable[[fx.Node], str],
                held_set: set[fx.Node]) -> tuple[list[int], list[str]]:
    """Per slot the bytes of the storage it brings (once per storage) and its meter category."""
    seen: set[fx.Node] = set()
    sizes, categories = [], []
    for n in [*fw_saved, None, *dropped_values]:
        if n is None:  # RNG states: a few KiB per random op, held until the recompute ran
            sizes += [0] * len(rng_names)
            categories += ["held"] * len(rng_names)
            continue
        root = storage_root(n)
        if root.op == "placeholder":
            index = primals.index(root) if root in primals else 0
            # parameters and buffers are never activation memory; a received value is the sender's
            sizes.append(0 if index < n_attrs or root in seen else storage_nbytes(root))
            categories.append("boundary" if index < n_attrs else "held" if n in held_set else input_category(root))
        else:
            sizes.append(0 if root in seen else storage_nbytes(root))
            categories.append("held" if n in held_set and n not in dropped_values else "stage")
        seen.add(root)
    return sizes, categories


