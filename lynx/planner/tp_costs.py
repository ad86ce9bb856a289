"""Costs of one tensor-parallel rank, from the marks :func:`lynx.frontend.tp_profile.annotate_tp` leaves.

A node marked ``tp_compute="shard"`` takes 1/tp of its arithmetic on a rank, ``"replicate"`` all
of it, and every rank pays its per-op host cost (``forward_host_s``/``backward_host_s``: the
generated code dispatching each op, which a shard does not make cheaper) whole; ``tp_output``
scales what it saves and outputs the same way; ``tp_allreduce`` is the (forward, backward)
bytes of the all-reduces it issues, priced on the TP link. A graph without
marks (synthetic graphs, models planned before sharding plans existed) keeps the uniform
approximation: everything divides by tp and each layer issues two activation-sized all-reduces
each way.

Example::

    >>> attrs = {"tp_compute": "shard", "tp_output": "replicate"}
    >>> time_share(attrs, 4), bytes_per_rank(1000, attrs, 4), bytes_per_rank(1000, {}, 4)
    (0.25, 1000, 250)
    >>> rank_seconds({"forward_s": 5.0, "forward_host_s": 3.0, **attrs}, "forward_s", 4)   # host 3 whole, 2 / 4
    3.5
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["time_share", "rank_seconds", "bytes_per_rank", "layer_allreduce_s", "device_param_bytes", "marked"]


def marked(attrs: Mapping[str, Any]) -> bool:
    """Whether a node carries a sharding plan's marks."""
    return "tp_compute" in attrs


def time_share(attrs: Mapping[str, Any], tp: int) -> float:
    """The share of a node's compute one of ``tp`` ranks runs."""
    return 1.0 if tp > 1 and attrs.get("tp_compute", "shard") == "replicate" else 1.0 / tp


def rank_seconds(attrs: Mapping[str, Any], key: str, tp: int) -> float:
    """A node's ``forward_s`` or ``backward_s`` (``key``) on one of ``tp`` ranks: the per-op host
    part whole, the rest by :func:`time_share` (a graph timed without the split scales all of it)."""
    total = float(attrs.get(key, 0.0))
    if tp <= 1:
        return total
    host = min(total, float(attrs.get(key.replace("_s", "_host_s"), 0.0)))
    return host + (total - host) * time_share(attrs, tp)


def bytes_per_rank(nbytes: Any, attrs: Mapping[str, Any], tp: int) -> int:
    """A node's bytes (saved, output) on one of ``tp`` ranks (rounded up: never optimistic)."""
    if tp > 1 and attrs.get("tp_output", "shard") == "replicate":
        return int(nbytes)
    return -(-int(nbytes) // tp)


def layer_allreduce_s(nodes: Sequence[Mapping[str, Any]], allreduce: Callable[[int], float],
                      activation_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's TP all-reduces: those the marks list, or two
    activation-sized ones each way for an unmarked layer."""
    if not any(marked(a) for a in nodes):
        return 2 * allreduce(activation_bytes), 2 * allreduce(activation_bytes)
    forward = sum(allreduce(int(a.get("tp_allreduce", (0, 0))[0])) for a in nodes if a.get("tp_allreduce", (0, 0))[0])
    backward = sum(allreduce(int(a.get("tp_allreduce", (0, 0))[1])) for a in nodes if a.get("tp_allreduce", (0, 0))[1])
    return forward, backward


def device_param_bytes(block: Mapping[str, Any], param_bytes: int, tp: int) -> int:
    """A block's parameter bytes on one of ``tp`` ranks: its sharded linears' 1/tp, the rest
    whole (replicated); an unmarked block divides everything by tp."""
    if "tp_sharded_param_bytes" not in block:
        return int(param_bytes) // tp
    sharded = int(block["tp_sharded_param_bytes"])
    return int(param_bytes) - sharded + sharded // tp
