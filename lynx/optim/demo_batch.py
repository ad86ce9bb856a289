"""DeMo's per-bucket compute, batched: one DCT, one top-k and one scatter per chunk shape.

A bucket's compressed tensors are grouped by chunk shape and dtype (a GPT block has two
groups: its matrices' 64×64 chunks and its vectors' 64-element chunks). Each group's chunks
are stacked into one ``(N, cr, cc)`` tensor, so a step costs a fixed number of tensor ops per
group instead of a dozen per parameter. Every chunk is still transformed, selected and
averaged on its own — the stacking changes no bit of the result — and the payload row keeps
:mod:`lynx.optim.demo_payload`'s layout byte for byte: the tables built once here say where
each group's values and index bits sit in the row, so packing and unpacking are one
``index_copy_`` / ``index_select`` per group.

Example::

    >>> import torch
    >>> from lynx.optim.demo_batch import BucketKernel
    >>> from lynx.optim.demo_payload import plan_bucket
    >>> shapes = [((128, 64), torch.float32), ((128,), torch.float32)]
    >>> plan = plan_bucket(shapes, topk=8, chunk=64, value_dtype=torch.bfloat16)
    >>> kernel = BucketKernel(plan, [d for _, d in shapes], torch.bfloat16, torch.device("cpu"))
    >>> momenta = [torch.randn(128, 64), torch.randn(128)]
    >>> row = kernel.compress(momenta)                  # error feedback applied to momenta
    >>> updates = kernel.decompress(row.unsqueeze(0))   # one rank: sign of the inverse DCT
    >>> [tuple(u.shape) for u in updates.values()]
    [(2, 1, 64, 64), (2, 64)]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynx.optim.bitpack import _shift_or_columns
from lynx.optim.dct import chunk_view, decode_chunks, encode_chunks
from lynx.optim.demo_payload import BucketPlan

__all__ = ["ChunkGroup", "BucketKernel", "from_grid"]


@dataclass
class ChunkGroup:
    """Compressed tensors of one bucket sharing a chunk shape and dtype, and their row tables."""

    chunk_shape: tuple[int, ...]
    dtype: torch.dtype
    k: int
    bits: int
    members: list[int]  # positions in the bucket
    starts: list[int]  # first chunk of each member in the group's stack
    n_chunks: int
    value_pos: torch.Tensor  # (N·k,) element positions in the row's value region
    bit_pos: torch.Tensor  # (N·k·bits,) bit positions in the row's index region
    first_byte: torch.Tensor  # (span, N·k) row bytes each index is read from
    shift: torch.Tensor  # (N·k,) bit offset of each index in its first byte
    # Reused every step: chunk stack, a zero (N, E) canvas for scattered coefficients (put
    # back to zero after use) and a zero per-coefficient sender count.
    blocks: torch.Tensor | None = None
    canvas: torch.Tensor | None = None
    senders: torch.Tensor | None = None
    work: dict[str, torch.Tensor] | None = None  # DCT intermediates and outputs, (N, ...) each


class BucketKernel:
    """Compress a bucket's momenta into its payload row, and decompress everyone's rows."""

    def __init__(self, plan: BucketPlan, dtypes: list[torch.dtype], value_dtype: torch.dtype, device: torch.device):
        self.plan = plan
        self.value_dtype = value_dtype
        value_size = torch.empty((), dtype=value_dtype).element_size()
        compressed = [j for j, tp in enumerate(plan.tensors) if tp.compressed]
        self.value_elems = sum(plan.tensors[j].value_bytes for j in compressed) // value_size
        index_start = min((plan.tensors[j].index_offset for j in compressed), default=0)
        self.index_range = (index_start, max((t.index_offset + t.index_bytes for t in plan.tensors if t.compressed), default=0))
        keys: dict[tuple, list[int]] = {}
        for j in compressed:
            keys.setdefault((plan.tensors[j].layout.chunk_shape, dtypes[j]), []).append(j)
        self.groups = [self._group(plan, shape, dtype, members, value_size, device) for (shape, dtype), members in keys.items()]

    def _group(self, plan: BucketPlan, shape: tuple[int, ...], dtype: torch.dtype, members: list[int],
               value_size: int, device: torch.device) -> ChunkGroup:
        tps = [plan.tensors[j] for j in members]
        k, bits = tps[0].k, tps[0].index_bits
        starts, n = [], 0
        for tp in tps:
            starts.append(n)
            n += tp.layout.n_chunks
        entries = torch.arange(k * n, dtype=torch.int64)  # (N·k,) entry index in the stack
        per_member = torch.tensor([tp.layout.n_chunks * k for tp in tps], dtype=torch.int64)
        which = torch.repeat_interleave(torch.arange(len(tps)), per_member)  # (N·k,) member of each entry
        local = entries - torch.tensor([s * k for s in starts], dtype=torch.int64)[which]  # entry within member
        value_pos = torch.tensor([tp.value_offset // value_size for tp in tps], dtype=torch.int64)[which] + local
        first_bit = torch.tensor([tp.index_offset * 8 for tp in tps], dtype=torch.int64)[which] + local * bits
        bit_pos = (first_bit.unsqueeze(1) + torch.arange(bits)).reshape(-1) - self.index_range[0] * 8
        span = (7 + bits + 7) // 8  # bytes an index can touch
        last = max(plan.sparse_bytes - 1, 0)
        # Bytes past the row's end only ever feed bits the mask drops: clamp to the last byte.
        first_byte = ((first_bit // 8).unsqueeze(0) + torch.arange(span).unsqueeze(1)).clamp_(max=last)
        return ChunkGroup(
            chunk_shape=shape, dtype=dtype, k=k, bits=bits, members=members, starts=starts, n_chunks=n,
            value_pos=value_pos.to(device), bit_pos=bit_pos.to(device),
            first_byte=first_byte.to(device), shift=(first_bit % 8).to(device),
        )

    # ------------------------------------------------------------------ sending side
    def compress(self, momenta: list[torch.Tensor]) -> torch.Tensor:
        """Top-k DCT coefficients of the compressed members' momenta, packed into one row.

        ``momenta`` are the bucket members' momenta, in bucket order (dense members are
        ignored). The transmitted part — values rounded to ``value_dtype`` — is subtracted
        from each momentum (error feedback). Returns the ``(sparse_bytes,)`` uint8 row.
        """
        plan = self.plan
        device = momenta[0].device
        row = torch.zeros(plan.sparse_bytes, dtype=torch.uint8, device=device)  # (P,)
        if not self.groups:
            return row
        values = row[: self.value_elems * torch.empty((), dtype=self.value_dtype).element_size()].view(self.value_dtype)
        lo, hi = self.index_range
        planes = torch.zeros((hi - lo) * 8, dtype=torch.uint8, device=device)  # (index bits,)
        for g in self.groups:
            blocks, canvas, _ = _buffers(g, device)
            work = g.work
            for j, start in zip(g.members, g.starts):
                tp = plan.tensors[j]
                blocks[start : start + tp.layout.n_chunks].view(_grid(tp.layout, g.chunk_shape)).copy_(
                    chunk_view(momenta[j].contiguous(), tp.layout)
                )
            coeffs = encode_chunks(blocks, mid=work["mid"], out=work["coeffs"])  # (N, E)
            idx = torch.abs(coeffs, out=work["magnitude"]).topk(g.k, dim=1, sorted=False).indices  # (N, k)
            vals = coeffs.gather(1, idx).to(self.value_dtype)  # (N, k)
            canvas.scatter_(1, idx, vals.to(coeffs.dtype))  # what was sent, zeros elsewhere
            back = decode_chunks(canvas, g.chunk_shape, mid=work["mid"], out=work["back"])  # (N, cr, cc)
            canvas.scatter_(1, idx, 0.0)
            for j, start in zip(g.members, g.starts):  # error feedback: the rounded values left m
                tp, m = plan.tensors[j], momenta[j]
                part = back[start : start + tp.layout.n_chunks].view(_grid(tp.layout, g.chunk_shape))
                if m.is_contiguous():
                    chunk_view(m, tp.layout).sub_(part)
                else:
                    m.sub_(from_grid(part, tp.layout))
            values.index_copy_(0, g.value_pos, vals.reshape(-1))
            shifts = torch.arange(g.bits, dtype=torch.int32, device=device)
            bits = ((idx.to(torch.int32).reshape(-1, 1) >> shifts) & 1).to(torch.uint8)  # (N·k, bits)
            planes.index_copy_(0, g.bit_pos, bits.reshape(-1))
        row[lo:hi] = _shift_or_columns(planes.view(-1, 8), 1)  # LSB first, like pack_bits
        return row

    # ------------------------------------------------------------------ receiving side
    def decompress(self, gathered: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every rank's rows ``(W, P)`` → ``sign(IDCT(mean))`` per compressed member.

        Each coefficient is the mean over the ranks that sent it. Returns, per member position,
        the sign of its update seen as chunks (:func:`~lynx.optim.dct.chunk_view`'s shape).
        """
        plan, world = self.plan, gathered.shape[0]
        out: dict[int, torch.Tensor] = {}
        if not self.groups:
            return out
        value_bytes = self.value_elems * torch.empty((), dtype=self.value_dtype).element_size()
        values = gathered[:, :value_bytes].view(self.value_dtype)  # (W, value elements)
        for g in self.groups:
            n, k = g.n_chunks, g.k
            vals = values.index_select(1, g.value_pos).to(g.dtype)  # (W, N·k)
            word = gathered.index_select(1, g.first_byte[0]).to(torch.int64)  # (W, N·k)
            for j in range(1, g.first_byte.shape[0]):
                word |= gathered.index_select(1, g.first_byte[j]).to(torch.int64) << (8 * j)
            idx = (word >> g.shift) & ((1 << g.bits) - 1)  # (W, N·k)
            vals = vals.view(world, n, k).permute(1, 0, 2).reshape(n, world * k)  # (N, W·k)
            idx = idx.view(world, n, k).permute(1, 0, 2).reshape(n, world * k)  # (N, W·k)
            # The mean over the ranks that sent each coefficient, as scatter_reduce_(mean,
            # include_self=False) computes it — (0 + v_r0) + v_r1 ... in rank order, then divided
            # by the sender count — but only ever touching the W·k coefficients sent per chunk.
            _, canvas, senders = _buffers(g, gathered.device)
            canvas.scatter_add_(1, idx, vals)  # (N, E) sums
            senders.scatter_add_(1, idx, torch.ones_like(vals))  # (N, E) sender counts
            mean = canvas.gather(1, idx).div_(senders.gather(1, idx))  # (N, W·k)
            canvas.scatter_(1, idx, mean)
            senders.scatter_(1, idx, 0.0)
            work = g.work
            signs = decode_chunks(canvas, g.chunk_shape, mid=work["mid"], out=work["back"]).sign_()  # (N, cr, cc)
            canvas.scatter_(1, idx, 0.0)
            for j, start in zip(g.members, g.starts):
                tp = plan.tensors[j]
                out[j] = signs[start : start + tp.layout.n_chunks].view(_grid(tp.layout, g.chunk_shape))
        return out


def _buffers(g: ChunkGroup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's reusable chunk stack ``(N, cr, cc)``, zero canvas and zero counts ``(N, E)``."""
    if g.blocks is None or g.blocks.device != device:
        g.blocks = torch.empty((g.n_chunks, *g.chunk_shape), dtype=g.dtype, device=device)
        g.canvas = torch.zeros((g.n_chunks, g.blocks[0].numel()), dtype=g.dtype, device=device)
        g.senders = torch.zeros_like(g.canvas)
        g.work = {
            "mid": torch.empty_like(g.blocks),
            "back": torch.empty_like(g.blocks),
            "coeffs": torch.empty_like(g.canvas),
            "magnitude": torch.empty_like(g.canvas),
        }
    return g.blocks, g.canvas, g.senders


def _grid(layout, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of :func:`chunk_view` for ``layout``: ``(R, C, cr, cc)`` or ``(n_chunks, c)``."""
    if len(chunk_shape) == 1:
        return (layout.n_chunks, chunk_shape[0])
    (rows, cols), (cr, cc) = layout.matrix_shape, chunk_shape
    return (rows // cr, cols // cc, cr, cc)


def from_grid(grid: torch.Tensor, layout) -> torch.Tensor:
    """Chunks in :func:`chunk_view`'s shape → a tensor of ``layout.shape`` (a copy)."""
    if grid.dim() == 2:
        return grid.reshape(layout.shape)
    return grid.permute(0, 2, 1, 3).reshape(layout.shape)
