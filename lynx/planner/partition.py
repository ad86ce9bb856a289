"""Stage partitioning and per-block costs: which blocks run on which pipeline stage, and what
each block costs in time (compute, tensor-parallel collectives) and static memory.

Blocks are the graph contract's ``pre`` edge block, the repeated layers and the ``post`` edge
block. Contiguous runs of blocks ("chunks", ``pp × virtual`` of them) are balanced by
forward+backward time: the chunk boundaries minimise the slowest chunk (exact dynamic
programme). The first chunk carries ``pre`` and the last ``post``; every chunk gets at least
one layer. Tensor parallelism is modelled as Megatron tensor + sequence parallelism: compute
and saved activations divide by ``tp``; each layer adds two activation-sized collectives to
its forward and two to its backward.

Example::

    >>> from lynx.planner.partition import balanced_boundaries
    >>> balanced_boundaries([1.0, 1.0, 1.0, 1.0], 2)
    [(0, 2), (2, 4)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import networkx as nx

from lynx.errors import LynxConfigError
from lynx.planner.tp_costs import device_param_bytes, layer_allreduce_s, marked, rank_seconds
from lynx.planner.comm import CommModel
from lynx.planner.cost import weight_grad_share
from lynx.units import dtype_bytes

__all__ = [
    "Chunk",
    "BlockCost",
    "balanced_boundaries",
    "partition_graph",
    "block_costs",
    "static_bytes_per_param",
]


@dataclass(frozen=True)
class Chunk:
    """A contiguous run of blocks executed by one device (pipeline stage)."""

    index: int                 # position in the pipeline (0 .. pp*virtual-1)
    device: int                # pipeline rank that runs it
    blocks: tuple[int, ...]    # indices into G.graph["blocks"]
    layers: tuple[int, ...]    # repeated-layer indices among them


@dataclass(frozen=True)
class BlockCost:
    """One block's per-microbatch costs on one device (already divided by tp)."""

    block: int
    name: str
    layer: Optional[int]
    forward_s: float           # compute of the forward
    backward_s: float          # compute of the backward (input and weight gradients)
    tp_forward_s: float        # tensor-parallel collectives in the forward (on the critical path)
    tp_backward_s: float       # ... in the backward: an idle window recomputation can fill
    param_bytes: int           # parameter bytes held by one device (÷ tp)
    dp_s: float                # data-parallel collective time of this block's gradients
    backward_weight_s: float = 0.0   # the weight-gradient part of backward_s (zero bubble's W)


def static_bytes_per_param(optimizer: str, dtype_size: int) -> int:
    """Weights + gradients + optimizer state per parameter, mixed precision.

    Weights and gradients in the model dtype; an fp32 master copy when the dtype is narrower;
    AdamW keeps two fp32 moments, DeMo and Lion one fp32 momentum (so AdamW in fp16 = 16 B).
    """
    master = 4 if dtype_size < 4 else 0
    moments = {"adamw": 8, "demo": 4, "lion": 4}.get(optimizer)
    if moments is None:
        raise LynxConfigError(f"unknown optimizer {optimizer!r}; use adamw, demo or lion")
    return 2 * dtype_size + master + moments


def balanced_boundaries(costs: Sequence[float], parts: int, *,
                        head: float = 0.0, tail: float = 0.0) -> list[tuple[int, int]]:
    """Split ``costs`` into ``parts`` contiguous non-empty ranges minimising the largest sum.

    ``head`` is added to the first range and ``tail`` to the last (the edge blocks).
    Ties are broken towards earlier boundaries, so the result is deterministic.
    """
    n = len(costs)
    if parts < 1 or parts > n:
        raise LynxConfigError(f"cannot split {n} layers into {parts} pipeline chunks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max over the first k ranges covering costs[:i]
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                seg = prefix[i] - prefix[j] + (head if k == 1 else 0.0) + (tail if k == parts else 0.0)
                value = max(best[k - 1][j], seg)
                if value < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = value, j
    ranges, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def partition_graph(graph: nx.DiGraph, *, pp: int, virtual: int = 1) -> list[Chunk]:
    """Balanced chunks of ``graph``'s blocks; chunk ``c`` runs on device ``c % pp``."""
    blocks = graph.graph["blocks"]
    layer_blocks = [b["index"] for b in blocks if b["kind"] == "layer"]
    n_chunks = pp * virtual
    if len(layer_blocks) < n_chunks:
        raise LynxConfigError(
            f"{n_chunks} pipeline chunks (pp={pp}" + (f" × virtual_stages={virtual}" if virtual > 1 else "")
            + f") but the model has only {len(layer_blocks)} layers: use pp <= {len(layer_blocks) // virtual}")

    def block_time(index: int) -> float:
        return sum(graph.nodes[n].get("forward_s", 0.0) + graph.nodes[n].get("backward_s", 0.0)
                   for n in blocks[index]["nodes"])

    first, last = layer_blocks[0], layer_blocks[-1]
    head = sum(block_time(b["index"]) for b in blocks if b["index"] < first)
    tail = sum(block_time(b["index"]) for b in blocks if b["index"] > last)
    ranges = balanced_boundaries([block_time(b) for b in layer_blocks], n_chunks, head=head, tail=tail)
    chunks = []
    for c, (lo, hi) in enumerate(ranges):
        members = list(layer_blocks[lo:hi])
        if c == 0:
            members = [b["index"] for b in blocks if b["index"] < first] + members
        if c == n_chunks - 1:
            members += [b["index"] for b in blocks if b["index"] > last]
        layers = tuple(blocks[b]["layer"] for b in members if blocks[b]["kind"] == "layer")
        chunks.append(Chunk(index=c, device=c % pp, blocks=tuple(members), layers=layers))
    return chunks


def block_costs(graph: nx.DiGraph, comm: CommModel, *, tp: int, optimizer: str) -> list[BlockCost]:
    """Per-block costs on one device, tensor parallelism and DP payloads included."""
    size = dtype_bytes(graph.graph.get("dims", {}).get("dtype"))
    param_bytes = graph.graph.get("param_bytes") or [0] * len(graph.graph["blocks"])
    costs = []
    for block in graph.graph["blocks"]:
        nodes = block["nodes"]
        # per TP rank: sharded ops' arithmetic 1/tp, replicated ones and every op's host cost whole
        # (lynx.planner.tp_costs)
        forward = sum(rank_seconds(graph.nodes[n], "forward_s", tp) for n in nodes)
        backward = sum(rank_seconds(graph.nodes[n], "backward_s", tp) for n in nodes)
        weight = sum(weight_grad_share(graph.nodes[n].get("op", "")) * rank_seconds(graph.nodes[n], "backward_s", tp)
                     for n in nodes)
        tp_forward = tp_backward = 0.0
        if tp > 1 and nodes:
            activation = int(graph.nodes[nodes[-1]].get("output_bytes", 0))  # the layer's output (s, b, h)
            if block["kind"] == "layer" or any(marked(graph.nodes[n]) for n in nodes):
                tp_forward, tp_backward = layer_allreduce_s([graph.nodes[n] for n in nodes], comm.tp_allreduce,
                                                            activation)
        device_params = device_param_bytes(block, int(param_bytes[block["index"]]), tp)
        costs.append(BlockCost(
            block=block["index"], name=block["name"], layer=block.get("layer"),
            forward_s=forward, backward_s=backward, tp_forward_s=tp_forward, tp_backward_s=tp_backward,
            param_bytes=device_params, dp_s=comm.dp_gradients(device_params // size), backward_weight_s=weight))
    return costs
