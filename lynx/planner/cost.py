"""The cost model: per-node forward and backward seconds, and α-β collective times.

Analytic mode is a roofline: an op costs ``max(FLOPs / achievable FLOP/s, bytes moved /
memory bandwidth)`` plus the hardware's per-op overhead; views cost nothing. Backward costs
twice the forward FLOPs (gradients for inputs and weights) and twice the bytes. Host costs
the hardware names (zero on the GPU presets) come on top: a random op draws one number per
output element (``rng_s_per_element``: on a CPU dropout's mask costs more than its memory
traffic). Stages run generated code (``lynx.rewrite.lower``): a node costs the host
``op_overhead_s`` per op its generated forward (``forward_ops``) and backward (``backward_ops``)
run, views included, where the profile traced them (CPU targets); else one op forward and one
backward (none for a view's backward). There is no per-node interpreter term.
:func:`optimizer_step_s` is one optimizer step over a device's parameters.
Collectives use ring formulas over a :class:`~lynx.planner.hardware.LinkSpec` (α latency per message
step, β bytes/s). :func:`lynx.frontend.measure.measure_times` instead times every node for real
on the current device.

Example::

    >>> from lynx.planner.cost import allreduce_time, p2p_time
    >>> from lynx.planner.hardware import LinkSpec
    >>> link = LinkSpec(alpha_s=0.0, beta_bytes_per_s=1e9)
    >>> p2p_time(1e9, link), allreduce_time(1e9, 4, link)
    (1.0, 1.5)
"""

from __future__ import annotations

import math
from typing import Any

import networkx as nx

from lynx.errors import LynxConfigError
from lynx.planner.hardware import HardwareSpec, LinkSpec

__all__ = [
    "random_elements",
    "node_forward_s",
    "node_backward_s",
    "weight_grad_share",
    "optimizer_step_s",
    "annotate_times",
    "p2p_time",
    "allreduce_time",
    "allgather_time",
    "reduce_scatter_time",
    "alltoall_time",
]


# ops that draw random numbers (one per output element): dropout's mask and its relatives
_RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "multinomial", "rrelu")


def random_elements(attrs: dict[str, Any]) -> int:
    """Random numbers a node draws: one per element of its first output for a random op, else 0."""
    op = str(attrs.get("op", ""))
    if not any(word in op for word in _RANDOM_OPS):
        return 0
    shapes = attrs.get("output_shapes") or []
    return sum(math.prod(shape) for shape in shapes[:1])


def _ops(attrs: dict[str, Any], key: str, unknown: int) -> int:
    """Ops the generated code runs for a node (``unknown`` where the profile did not trace them)."""
    count = attrs.get(key)
    return unknown if count is None else count


def node_forward_s(attrs: dict[str, Any], hw: HardwareSpec, dtype: str) -> float:
    overhead = _ops(attrs, "forward_ops", 1) * hw.op_overhead_s
    if attrs.get("is_view"):
        return overhead  # a view is a dispatched op in the generated code, no arithmetic
    compute = attrs["flops"] / hw.achievable_flops(dtype)
    memory = (attrs["input_bytes"] + attrs["output_bytes"]) / hw.memory_bandwidth
    rng = random_elements(attrs) * hw.rng_s_per_element
    return max(compute, memory) + rng + overhead


def node_backward_s(attrs: dict[str, Any], hw: HardwareSpec, dtype: str) -> float:
    if attrs.get("is_view"):
        return _ops(attrs, "backward_ops", 0) * hw.op_overhead_s
    compute = 2 * attrs["flops"] / hw.achievable_flops(dtype)
    memory = 2 * (attrs["input_bytes"] + attrs["output_bytes"]) / hw.memory_bandwidth
    return max(compute, memory) + _ops(attrs, "backward_ops", 1) * hw.op_overhead_s


# share of a node's backward that computes its parameters' gradients (zero bubble's W): a
# linear's weight gradient costs what its input gradient does; an embedding's backward is all
# weight gradient (indices have none); a norm computes both in one kernel, which stays with
# the input gradient
_WEIGHT_SHARE = {"aten.linear.default": 0.5, "aten.embedding.default": 1.0}


def weight_grad_share(op: str) -> float:
    """The part of ``op``'s backward time that computes weight gradients (0 for most ops)."""
    return _WEIGHT_SHARE.get(op, 0.0)


def optimizer_step_s(params: int, optimizer: str, hw: HardwareSpec) -> float:
    """One ``optimizer`` step over ``params`` parameters of one device (its own work; the
    data-parallel exchange is timed apart). 0 where the hardware does not model it."""
    return max(0, params) * hw.optimizer_s_per_param.get(optimizer, 0.0)


def annotate_times(G: nx.DiGraph, hw: HardwareSpec, dtype: str | None = None) -> nx.DiGraph:
    """Fill ``forward_s`` and ``backward_s`` of every node from the analytic model, and the
    per-op host part of each (``forward_host_s``, ``backward_host_s``)."""
    dtype = dtype or (G.graph.get("dims") or {}).get("dtype") or "float32"
    for _, attrs in G.nodes(data=True):
        attrs["forward_s"] = node_forward_s(attrs, hw, dtype)
        attrs["backward_s"] = node_backward_s(attrs, hw, dtype)
        # the per-op host part, which a tensor-parallel rank pays whole (lynx.planner.tp_costs)
        attrs["forward_host_s"] = _ops(attrs, "forward_ops", 1) * hw.op_overhead_s
        attrs["backward_host_s"] = _ops(attrs, "backward_ops", 0 if attrs.get("is_view") else 1) * hw.op_overhead_s
    G.graph["hardware"] = hw.name
    G.graph["time_source"] = "analytic"
    return G


# --- collectives ----------------------------------------------------------------------------


def _check(nbytes: float, world: int) -> None:
    if nbytes < 0 or world < 1:
        raise LynxConfigError(f"collective needs nbytes >= 0 and world >= 1, got {nbytes}, {world}")


def p2p_time(nbytes: float, link: LinkSpec) -> float:
    """One point-to-point transfer of ``nbytes``."""
    _check(nbytes, 1)
    return 0.0 if nbytes == 0 else link.alpha_s + nbytes / link.beta_bytes_per_s


def allreduce_time(nbytes: float, world: int, link: LinkSpec) -> float:
    """Ring all-reduce of ``nbytes`` per rank: ``2(W−1)`` steps moving ``2(W−1)/W·n`` bytes."""
    _check(nbytes, world)
    if world == 1 or nbytes == 0:
        return 0.0
    return 2 * (world - 1) * link.alpha_s + 2 * (world - 1) / world * nbytes / link.beta_bytes_per_s


def allgather_time(nbytes: float, world: int, link: LinkSpec) -> float:
    """Ring all-gather where each rank contributes ``nbytes``: ``(W−1)·n`` bytes in."""
    _check(nbytes, world)
    if world == 1 or nbytes == 0:
        return 0.0
    return (world - 1) * link.alpha_s + (world - 1) * nbytes / link.beta_bytes_per_s


def reduce_scatter_time(nbytes: float, world: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of ``nbytes`` per rank: ``(W−1)/W·n`` bytes."""
    _check(nbytes, world)
    if world == 1 or nbytes == 0:
        return 0.0
    return (world - 1) * link.alpha_s + (world - 1) / world * nbytes / link.beta_bytes_per_s


def alltoall_time(nbytes: float, world: int, link: LinkSpec) -> float:
    """All-to-all where each rank holds ``nbytes`` split evenly across ranks."""
    _check(nbytes, world)
    if world == 1 or nbytes == 0:
        return 0.0
    return (world - 1) * link.alpha_s + (world - 1) / world * nbytes / link.beta_bytes_per_s
