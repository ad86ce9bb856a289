"""DeMo's per-bucket compute, batched, with the momentum held as DCT coefficients.

A bucket's compressed tensors are grouped by chunk shape and dtype (a GPT block has two
groups: its matrices' 64×64 chunks and its vectors' 64-element chunks). Each group's chunks
are stacked into one ``(N, cr, cc)`` tensor, so a step costs a fixed number of tensor ops per
group instead of a dozen per parameter. Every chunk is still transformed, selected and
averaged on its own, and the payload row keeps :mod:`lynx.optim.demo_payload`'s layout byte
for byte: the tables built once here say where each group's values and index bits sit in the
row, so packing and unpacking are a few ``index_copy_`` / ``index_add_`` / ``index_select``
per group.

**The momentum lives in the DCT domain.** The chunked DCT is linear and orthonormal, so
DeMo's ``m ← β·m + lr·g; C = DCT(m); m ← m − IDCT(kept)`` is, coefficient for coefficient,
``M ← β·M + lr·DCT(g); M[kept] ← M[kept] − round(M[kept])`` with ``M = DCT(m)``. The group
keeps ``M`` as one ``(N, chunk elements)`` stack: a step transforms the gradient once, and the
error feedback is an exact subtraction at the ``k`` sent coefficients instead of an inverse
DCT of the whole stack (one transform of three saved, and no round-off of ``IDCT(DCT(·))``
left in the momentum).

Example::

    >>> import torch
    >>> from lynx.optim.demo_batch import BucketKernel
    >>> from lynx.optim.demo_payload import plan_bucket
    >>> shapes = [((128, 64), torch.float32), ((128,), torch.float32)]
    >>> plan = plan_bucket(shapes, topk=8, chunk=64, value_dtype=torch.bfloat16)
    >>> kernel = BucketKernel(plan, [d for _, d in shapes], torch.bfloat16, torch.device("cpu"))
    >>> grads = [torch.randn(128, 64), torch.randn(128)]
    >>> row = kernel.compress(grads, [(0.9, 1e-3)] * 2)  # momentum updated, sent part removed
    >>> tuple(kernel.momentum_of(0).shape)              # member 0's DCT-domain momentum
    (2, 4096)
    >>> updates = kernel.decompress(row.unsqueeze(0))   # one rank: sign of the inverse DCT
    >>> [tuple(u.shape) for u in updates.values()]
    [(2, 1, 64, 64), (2, 64)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch

from lynx.optim.dct import chunk_view, decode_chunks, encode_chunks
from lynx.optim.demo_payload import BucketPlan
from lynx.optim.topk import topk_rows
from lynx.torch_private import foreach_copy_

__all__ = ["ChunkGroup", "BucketKernel", "from_grid"]

_T = TypeVar("_T")


def _compressed(value: Optional[_T], member: int) -> _T:
    """A compressed bucket member's gradient or settings (only dense members' are None)."""
    assert value is not None, f"bucket member {member} is compressed: it has a gradient and settings"
    return value


@dataclass
class ChunkGroup:
    """Compressed tensors of one bucket sharing a chunk shape and dtype, their tables and buffers."""

    chunk_shape: tuple[int, ...]
    dtype: torch.dtype
    k: int
    bits: int
    members: list[int]  # positions in the bucket
    starts: list[int]  # first chunk of each member in the group's stack
    n_chunks: int
    value_pos: torch.Tensor  # (N·k,) element positions in the row's value region
    first_byte: torch.Tensor  # (span, N·k) row bytes each index touches (clamped to the row)
    pack_byte: torch.Tensor  # (span, N·k) the same, relative to the index region (clamped to it)
    shift: torch.Tensor  # (N·k,) bit offset of each index in its first byte
    momentum: torch.Tensor  # (N, E) DCT-domain momentum: the optimizer state
    blocks: torch.Tensor  # (N, cr, cc) gradient chunks
    mid: torch.Tensor  # (N, cr, cc) DCT intermediate
    back: torch.Tensor  # (N, cr, cc) inverse DCT output
    coeffs: torch.Tensor  # (N, E) DCT of the gradient
    magnitude: torch.Tensor  # (N, E)
    canvas: torch.Tensor  # (N, E) zero; scattered means, put back to zero after use
    senders: torch.Tensor  # (N, E) zero per-coefficient sender counts, likewise


class BucketKernel:
    """Compress a bucket's gradients into its payload row, and decompress everyone's rows.

    Holds the DCT-domain momentum of the bucket's compressed members
    (:meth:`momentum_of`); dense members are the optimizer's business.
    """

    def __init__(self, plan: BucketPlan, dtypes: list[torch.dtype], value_dtype: torch.dtype, device: torch.device):
        self.plan = plan
        self.value_dtype = value_dtype
        self.device = device
        value_size = torch.empty((), dtype=value_dtype).element_size()
        compressed = [j for j, tp in enumerate(plan.tensors) if tp.compressed]
        self.value_elems = sum(plan.tensors[j].value_bytes for j in compressed) // value_size
        index_start = min((plan.tensors[j].index_offset for j in compressed), default=0)
        self.index_range = (
            index_start,
            max((t.index_offset + t.index_bytes for t in plan.tensors if t.compressed), default=0),
        )
        keys: dict[tuple, list[int]] = {}
        for j in compressed:
            keys.setdefault((plan.tensors[j].layout.chunk_shape, dtypes[j]), []).append(j)
        self.groups = [
            self._group(plan, shape, dtype, members, value_size, device) for (shape, dtype), members in keys.items()
        ]
        self._where = {j: (g, start) for g in self.groups for j, start in zip(g.members, g.starts)}
        # Per group, per member: (bucket position, first chunk, end chunk, chunk_view shape, layout).
        self._spans = [
            [
                (
                    j,
                    start,
                    start + plan.tensors[j].layout.n_chunks,
                    _grid(plan.tensors[j].layout, g.chunk_shape),
                    plan.tensors[j].layout,
                )
                for j, start in zip(g.members, g.starts)
            ]
            for g in self.groups
        ]
        # Fixed views into the reused buffers: each member's gradient chunks and update signs.
        self._block_views = [
            [g.blocks[a:b].view(grid) for _, a, b, grid, _ in spans] for g, spans in zip(self.groups, self._spans)
        ]
        self.signs = {
            j: g.back[a:b].view(grid) for g, spans in zip(self.groups, self._spans) for j, a, b, grid, _ in spans
        }

    def _group(
        self,
        plan: BucketPlan,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        members: list[int],
        value_size: int,
        device: torch.device,
    ) -> ChunkGroup:
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
        span = (7 + bits + 7) // 8  # bytes an index can touch
        touched = (first_bit // 8).unsqueeze(0) + torch.arange(span).unsqueeze(1)  # (span, N·k)
        # Bytes past the row's (or the index region's) end only ever hold bits that are zero:
        # clamp them to the last byte, where reading drops them and writing adds zero.
        first_byte = touched.clamp(max=max(plan.sparse_bytes - 1, 0))
        lo, hi = self.index_range
        pack_byte = (touched - lo).clamp_(max=max(hi - lo - 1, 0))
        stack = torch.zeros((n, *shape), dtype=dtype, device=device)
        flat = torch.zeros((n, stack[0].numel()), dtype=dtype, device=device)
        return ChunkGroup(
            chunk_shape=shape,
            dtype=dtype,
            k=k,
            bits=bits,
            members=members,
            starts=starts,
            n_chunks=n,
            value_pos=value_pos.to(device),
            first_byte=first_byte.to(device),
            pack_byte=pack_byte.to(device),
            shift=(first_bit % 8).to(device=device, dtype=torch.int32),
            momentum=flat,
            blocks=torch.empty_like(stack),
            mid=torch.empty_like(stack),
            back=torch.empty_like(stack),
            coeffs=torch.empty_like(flat),
            magnitude=torch.empty_like(flat),
            canvas=torch.zeros_like(flat),
            senders=torch.zeros_like(flat),
        )

    def momentum_of(self, j: int) -> torch.Tensor:
        """Bucket member ``j``'s DCT-domain momentum, ``(n_chunks, chunk_elements)`` — a view."""
        g, start = self._where[j]
        return g.momentum[start : start + self.plan.tensors[j].layout.n_chunks]

    # ------------------------------------------------------------------ sending side
    def compress(self, grads: Sequence[torch.Tensor | None],
                 settings: Sequence[tuple[float, float] | None]) -> torch.Tensor:
        """Update the momenta with ``grads``, pack their top-k coefficients into one row.

        ``grads`` and ``settings`` (``(decay, lr)``) are per bucket member, in bucket order;
        dense members' entries are ignored. Per group: ``M ← decay·M + lr·DCT(g)``, the ``k``
        largest-magnitude coefficients of every chunk are sent as ``value_dtype`` values, and
        the sent (rounded) values leave ``M`` (error feedback). Returns the ``(sparse_bytes,)``
        uint8 row.
        """
        plan = self.plan
        row = torch.zeros(plan.sparse_bytes, dtype=torch.uint8, device=self.device)  # (P,)
        if not self.groups:
            return row
        values = row[: self.value_elems * torch.empty((), dtype=self.value_dtype).element_size()].view(self.value_dtype)
        lo, hi = self.index_range
        words = torch.zeros(hi - lo, dtype=torch.int32, device=self.device)  # (index bytes,) OR-ed bits
        for g, spans, block_views in zip(self.groups, self._spans, self._block_views):
            blocks, mom = g.blocks, g.momentum
            foreach_copy_(
                block_views, [chunk_view(_compressed(grads[j], j).contiguous(), layout)
                              for j, _, _, _, layout in spans]
            )
            coeffs = encode_chunks(blocks, mid=g.mid, out=g.coeffs)  # (N, E) DCT of the gradient
            scales = {_compressed(settings[j], j) for j in g.members}
            if len(scales) == 1:
                decay, lr = scales.pop()
                mom.mul_(decay).add_(coeffs, alpha=lr)
            else:  # members from param groups with different settings
                for j, start, end, _, _ in spans:
                    decay, lr = _compressed(settings[j], j)
                    mom[start:end].mul_(decay).add_(coeffs[start:end], alpha=lr)
            idx = topk_rows(mom, g.k, scratch=g.magnitude)  # (N, k) largest |M|, ties → lower index
            picked = mom.gather(1, idx)  # (N, k)
            vals = picked.to(self.value_dtype, copy=True)  # (N, k) what is sent (never an alias of picked)
            mom.scatter_(1, idx, picked.sub_(vals.to(g.dtype)))  # error feedback: only the rounding stays
            values.index_copy_(0, g.value_pos, vals.reshape(-1))
            # Indices into the bit stream, LSB first: index i's bit b is stream bit first_bit+b.
            # Bits of different indices never overlap, so adding bytes is OR-ing them.
            word = idx.reshape(-1).to(torch.int32) << g.shift  # (N·k,) ≤ bits+7 bits
            for byte in range(g.pack_byte.shape[0]):
                words.index_add_(0, g.pack_byte[byte], (word >> (8 * byte)) & 0xFF)
        row[lo:hi] = words.to(torch.uint8)
        return row

    # ------------------------------------------------------------------ receiving side
    def decompress(self, gathered: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every rank's rows ``(W, P)`` → ``sign(IDCT(mean))`` per compressed member.

        Each coefficient is the mean over the ranks that sent it. Returns ``signs``: per
        member position, the sign of its update seen as chunks (:func:`~lynx.optim.dct.chunk_view`'s
        shape) — views of a buffer the next call overwrites.
        """
        world = gathered.shape[0]
        if not self.groups:
            return self.signs
        value_bytes = self.value_elems * torch.empty((), dtype=self.value_dtype).element_size()
        values = gathered[:, :value_bytes].view(self.value_dtype)  # (W, value elements)
        for g in self.groups:
            n, k = g.n_chunks, g.k
            vals = values.index_select(1, g.value_pos).to(g.dtype)  # (W, N·k)
            wide = torch.int32 if 8 * g.first_byte.shape[0] <= 31 else torch.int64
            word = gathered.index_select(1, g.first_byte[0]).to(wide)  # (W, N·k)
            for j in range(1, g.first_byte.shape[0]):
                word |= gathered.index_select(1, g.first_byte[j]).to(wide) << (8 * j)
            idx = ((word >> g.shift) & ((1 << g.bits) - 1)).to(torch.int64)  # (W, N·k)
            vals = vals.view(world, n, k).permute(1, 0, 2).reshape(n, world * k)  # (N, W·k)
            idx = idx.view(world, n, k).permute(1, 0, 2).reshape(n, world * k)  # (N, W·k)
            # The mean over the ranks that sent each coefficient, as scatter_reduce_(mean,
            # include_self=False) computes it — (0 + v_r0) + v_r1 ... in rank order, then divided
            # by the sender count — but only ever touching the W·k coefficients sent per chunk.
            canvas, senders = g.canvas, g.senders
            canvas.scatter_add_(1, idx, vals)  # (N, E) sums
            senders.scatter_add_(1, idx, torch.ones_like(vals))  # (N, E) sender counts
            mean = canvas.gather(1, idx).div_(senders.gather(1, idx))  # (N, W·k)
            canvas.scatter_(1, idx, mean)
            senders.scatter_(1, idx, 0.0)
            decode_chunks(canvas, g.chunk_shape, mid=g.mid, out=g.back).sign_()  # (N, cr, cc) into self.signs
            canvas.scatter_(1, idx, 0.0)
        return self.signs


def _grid(layout, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of :func:`chunk_view` for ``layout``: ``(R, C, cr, cc)`` or ``(n_chunks, c)``."""
    if len(chunk_shape) == 1:
        return (layout.n_chunks, chunk_shape[0])
    (rows, cols), (cr, cc) = layout.matrix_shape, layout.chunk_shape
    return (rows // cr, cols // cc, cr, cc)


def from_grid(grid: torch.Tensor, layout) -> torch.Tensor:
    """Chunks in :func:`chunk_view`'s shape → a tensor of ``layout.shape`` (a copy)."""
    if grid.dim() == 2:
        return grid.reshape(layout.shape)
    return grid.permute(0, 2, 1, 3).reshape(layout.shape)
