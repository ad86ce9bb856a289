"""Recomputation inside tensor-parallel windows: between a backward all-reduce and its wait.

A tensor-parallel stage's backward graph issues each TP all-reduce
(``_c10d_functional.all_reduce``, asynchronous) and later waits for it (``wait_tensor``).
A plan's window ``s{d}.tp.l{L}.b.mb{j}`` holds recomputation for layers below ``L`` that may
run while layer ``L``'s backward all-reduces are in flight. :func:`window_targets` assigns
that recomputation to layer ``L``'s backward all-reduces of the joint graph — split over them
in forward order, equal shares, the first share to the first all-reduce the backward issues —
and :mod:`lynx.rewrite.emit` writes it into the backward graph right after the all-reduce,
before its ``wait_tensor``. The assignment depends only on the plan and the joint graph, so
every rank of the TP group generates the same code: the same collectives in the same order,
none of them recomputed (:func:`lynx.rewrite.lower.lower` keeps collectives out of every
dropped region).

:class:`TPWindowLog` (a graph attribute, ``lynx_tp_log``) times each window's recomputation
and the wait after it: a wait that still blocked means the all-reduce was in flight for the
whole recomputation, which counts as *hidden*; otherwise as *exposed*.

Example::

    >>> log = TPWindowLog()
    >>> tp_segment_start(log); tp_segment_stop(log); tp_wait_start(log); tp_wait_stop(log)
    >>> len(log.segments), log.hidden_s() >= 0.0
    (1, True)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from lynx.frontend.joint_tp import collective_origin

__all__ = ["TPWindowLog", "tp_segment_start", "tp_segment_stop", "tp_wait_start", "tp_wait_stop",
           "backward_allreduces", "window_targets", "WAIT_BLOCKED_S"]

# a wait that took longer than this found its all-reduce still in flight (a completed one returns in µs)
WAIT_BLOCKED_S = 50e-6
class TPWindowLog(torch.nn.Module):
    """Per TP window of one backward run: (recompute seconds, wait seconds after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[tuple[float, float]] = []
        self._since = 0.0
        self._segment = 0.0

    def reset(self) -> None:
        self.segments = []

    def hidden_s(self) -> float:
        """Recompute seconds whose all-reduce was still in flight when they ended."""
        return sum(r for r, w in self.segments if w > WAIT_BLOCKED_S)

    def exposed_s(self) -> float:
        return sum(r for r, w in self.segments if w <= WAIT_BLOCKED_S)


def tp_segment_start(log: TPWindowLog) -> None:
    log._since = time.perf_counter()


def tp_segment_stop(log: TPWindowLog) -> None:
    log._segment = time.perf_counter() - log._since


def tp_wait_start(log: TPWindowLog) -> None:
    log._since = time.perf_counter()


def tp_wait_stop(log: TPWindowLog) -> None:
    log.segments.append((log._segment, time.perf_counter() - log._since))


def _is_allreduce(n: fx.Node) -> bool:
    return n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait_tensor" not in str(n.target)


def backward_allreduces(joint_gm: fx.GraphModule, forward: set[fx.Node]) -> list[fx.Node]:
    """The collectives the backward issues, in the joint graph's order."""
    return [n for n in joint_gm.graph.nodes if n not in forward and _is_allreduce(n)]


def window_targets(collectives: Sequence[fx.Node], origin: Mapping[str, str], layer_of: Mapping[str, Any],
                   windows: Sequence[tuple[int, Sequence[str]]], dropped_by_node: Mapping[str, Sequence[int]],
                   available: frozenset[int]) -> tuple[tuple[int, frozenset[int]], ...]:
    """``(index of the backward collective, dropped slots to recompute after it)`` for the
    plan's TP ``windows`` (``(layer L, captured nodes in forward order)``) of one microbatch.

    Layer ``L``'s collectives are those whose origin (the captured node they come from) lies in
    layer ``L``; a window whose layer has none in this stage is left to on-demand recompute."""
    by_layer: dict[Any, list[int]] = {}
    for k, n in enumerate(collectives):
        layer = layer_of.get(collective_origin(n, origin))
        if layer is not None:
            by_layer.setdefault(layer, []).append(k)
    out: dict[int, set[int]] = {}
    for layer, nodes in windows:
        ks = by_layer.get(layer)
        if not ks:
            continue
        share = -(-len(nodes) // len(ks))
        for i, k in enumerate(ks):
            slots = {s for name in nodes[i * share:(i + 1) * share] for s in dropped_by_node.get(name, ())}
            slots -= available
            if slots:
                out.setdefault(k, set()).update(slots)
    return tuple(sorted((k, frozenset(s)) for k, s in out.items()))
