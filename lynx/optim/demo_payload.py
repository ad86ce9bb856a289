"""DeMo's payload layout: which tensors are compressed, and where their bytes go.

The layout depends only on parameter shapes and dtypes, so the same code sizes the real
payloads (in :class:`lynx.optim.DeMo`) and the analytic ones (in ``benchmarks/comm_bytes.py``,
over a model too large to allocate).

One bucket's sparse payload is a flat ``uint8`` tensor, per rank::

    [ values of tensor 0 | values of tensor 1 | ... | packed indices of tensor 0 | ... | pad ]

values in ``value_dtype`` (bf16 by default), ``(n_chunks, k)`` each; indices are each
chunk's top-k positions, held in the smallest integer dtype that fits the chunk and sent
bit-packed at ``ceil(log2(chunk_elements))`` bits each (12 bits for a 64×64 chunk, where an
int16 would waste 4). The row is padded to a multiple of 8 bytes so it can be re-viewed as
values after the all-gather. Tensors for which the sparse form is not smaller than the dense
one go into a separate dense tensor (parameter dtype), averaged with one all-reduce.

Example::

    >>> import torch
    >>> from lynx.optim.demo_payload import plan_bucket
    >>> plan = plan_bucket([((2048, 2048), torch.float32), ((2048,), torch.float32)],
    ...                    topk=32, chunk=64, value_dtype=torch.bfloat16)
    >>> plan.sparse_bytes, plan.dense_numel      # 1024 chunks·32·(2 B + 1.5 B) + 32·32·(2 B + 0.75 B)
    (117504, 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lynx.optim.buckets import all_gather_bytes, assign_buckets, bits_for, ring_all_reduce_bytes
from lynx.optim.dct import ChunkLayout

__all__ = ["TensorPlan", "BucketPlan", "plan_tensor", "plan_bucket", "demo_wire_bytes"]

_ALIGN = 8  # bytes: each rank's row starts aligned for any value dtype


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's place in its bucket's payload."""

    layout: ChunkLayout
    compressed: bool
    k: int  # coefficients sent per chunk (compressed tensors)
    index_bits: int  # bits per packed index
    value_offset: int = 0  # byte offsets inside the sparse row
    value_bytes: int = 0
    index_offset: int = 0
    index_bytes: int = 0
    dense_offset: int = 0  # element offset inside the dense tensor
    numel: int = 0


@dataclass(frozen=True)
class BucketPlan:
    tensors: list[TensorPlan]
    sparse_bytes: int  # per-rank bytes of the all-gathered row (0: no all-gather)
    dense_numel: int  # elements of the all-reduced dense tensor (0: no all-reduce)
    dense_dtype: torch.dtype


def plan_tensor(
    shape: tuple[int, ...], param_dtype: torch.dtype, topk: int, chunk: int, value_dtype: torch.dtype
) -> TensorPlan:
    """Chunk layout and compressed/dense decision for one tensor (offsets filled later)."""
    layout = ChunkLayout.for_shape(shape, chunk)
    elems = layout.chunk_elements
    k = min(topk, elems)
    index_bits = bits_for(elems)
    value_size = torch.empty((), dtype=value_dtype).element_size()
    sparse = layout.n_chunks * k * value_size + math.ceil(layout.n_chunks * k * index_bits / 8)
    dense = layout.numel * torch.empty((), dtype=param_dtype).element_size()
    # Compression pays only if fewer coefficients than the chunk holds are sent and the
    # sparse payload is smaller than the dense one.
    compressed = k < elems and sparse < dense
    return TensorPlan(layout=layout, compressed=compressed, k=k, index_bits=index_bits, numel=layout.numel)


def plan_bucket(
    shapes: list[tuple[tuple[int, ...], torch.dtype]], topk: int, chunk: int, value_dtype: torch.dtype
) -> BucketPlan:
    """Offsets of every tensor of a bucket in its sparse row and its dense tensor."""
    value_size = torch.empty((), dtype=value_dtype).element_size()
    plans = [plan_tensor(tuple(s), d, topk, chunk, value_dtype) for s, d in shapes]
    dense_dtypes = [d for (_, d), p in zip(shapes, plans) if not p.compressed]
    dense_dtype = dense_dtypes[0] if dense_dtypes else torch.float32
    for d in dense_dtypes[1:]:
        dense_dtype = torch.promote_types(dense_dtype, d)
    out: list[TensorPlan] = []
    offset = 0
    for p in plans:  # values first: every value slice stays aligned to the value size
        if p.compressed:
            n = p.layout.n_chunks * p.k * value_size
            p = TensorPlan(**{**p.__dict__, "value_offset": offset, "value_bytes": n})
            offset += n
        out.append(p)
    dense_at = 0
    for i, p in enumerate(out):
        if p.compressed:
            n = math.ceil(p.layout.n_chunks * p.k * p.index_bits / 8)
            out[i] = TensorPlan(**{**p.__dict__, "index_offset": offset, "index_bytes": n})
            offset += n
        else:
            out[i] = TensorPlan(**{**p.__dict__, "dense_offset": dense_at})
            dense_at += p.numel
    sparse_bytes = offset + (-offset) % _ALIGN if offset else 0
    return BucketPlan(tensors=out, sparse_bytes=sparse_bytes, dense_numel=dense_at, dense_dtype=dense_dtype)


def demo_wire_bytes(
    shapes: list[tuple[int, ...]],
    world_size: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    topk: int = 32,
    chunk: int = 64,
    value_dtype: torch.dtype = torch.bfloat16,
    bucket_bytes: int | None = None,
) -> dict[str, float]:
    """Analytic per-rank wire bytes of one DeMo step over parameters of ``shapes``.

    Uses the same bucketing and payload planning as :class:`lynx.optim.DeMo`, so it equals
    the optimizer's ``last_step_bytes`` for the same shapes (checked in the tests).
    """
    from lynx.optim.buckets import DEFAULT_BUCKET_BYTES

    size = torch.empty((), dtype=param_dtype).element_size()
    buckets = assign_buckets([math.prod(s) * size for s in shapes], bucket_bytes or DEFAULT_BUCKET_BYTES)
    sent = 0.0
    collectives = 0
    for members in buckets:
        plan = plan_bucket([(shapes[i], param_dtype) for i in members], topk, chunk, value_dtype)
        if world_size > 1 and plan.sparse_bytes:
            sent += all_gather_bytes(plan.sparse_bytes, world_size)
            collectives += 1
        if world_size > 1 and plan.dense_numel:
            dsize = torch.empty((), dtype=plan.dense_dtype).element_size()
            sent += ring_all_reduce_bytes(plan.dense_numel * dsize, world_size)
            collectives += 1
    return {"sent": sent, "received": sent, "collectives": collectives, "buckets": len(buckets)}
