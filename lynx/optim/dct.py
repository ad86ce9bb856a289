"""Chunked orthonormal DCT-II, the transform DeMo compresses momenta in.

A tensor is viewed as a matrix (vectors stay 1-D; tensors of more than two dimensions have
their leading dimensions flattened into rows), each dimension is split into chunks of its
largest divisor not above the target chunk size, and every chunk is transformed with the
orthonormal DCT-II matrix of its size. Encoding returns the coefficients as
``(n_chunks, chunk_elements)``; decoding is the exact inverse (the transform is orthonormal,
so the inverse is the transpose).

Example::

    >>> import torch
    >>> from lynx.optim.dct import ChunkLayout, encode, decode
    >>> layout = ChunkLayout.for_shape((128, 96), chunk=64)
    >>> layout.chunk_shape, layout.n_chunks
    ((64, 48), 4)
    >>> x = torch.randn(128, 96, dtype=torch.float64)
    >>> coeffs = encode(x, layout)                     # (4, 3072)
    >>> bool(torch.allclose(decode(coeffs, layout), x))
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "largest_divisor_at_most",
    "dct_matrix",
    "ChunkLayout",
    "encode",
    "decode",
    "chunk_view",
    "encode_chunks",
    "decode_chunks",
]


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ``<= limit`` (1 if only 1 qualifies)."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


@lru_cache(maxsize=64)
def _dct_matrix_cached(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)  # (n, 1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)  # (1, n)
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n))  # (n, n)
    scale = torch.full((n, 1), math.sqrt(2.0 / n), dtype=torch.float64)
    scale[0, 0] = math.sqrt(1.0 / n)  # orthonormal: the DC row has its own scale
    return (basis * scale).to(dtype=dtype, device=device)


_MATRICES: dict[tuple, torch.Tensor] = {}  # (n, dtype, device as given) → matrix: a cheap lookup per step


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal DCT-II matrix ``D`` of size ``(n, n)``: ``y = D @ x``, ``x = D.T @ y``."""
    key = (n, dtype, device)
    matrix = _MATRICES.get(key)
    if matrix is None:
        matrix = _MATRICES[key] = _dct_matrix_cached(n, dtype, str(device))
    return matrix


@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor of ``shape`` is cut into DCT chunks.

    ``matrix_shape`` is the 1-D or 2-D view the chunks tile; ``chunk_shape`` the chunk's
    size along each of its dimensions.
    """

    shape: tuple[int, ...]
    matrix_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    @staticmethod
    def for_shape(shape: tuple[int, ...] | torch.Size, chunk: int) -> "ChunkLayout":
        shape = tuple(int(s) for s in shape)
        if len(shape) == 0:
            matrix: tuple[int, ...] = (1,)
        elif len(shape) == 1:
            matrix = shape
        else:
            # Leading dimensions flatten into rows: a conv kernel (O, I, kh, kw) becomes
            # (O·I·kh, kw), keeping the last (often contiguous, spatially smooth) dimension.
            matrix = (math.prod(shape[:-1]), shape[-1])
        chunks = tuple(largest_divisor_at_most(s, chunk) if s > 0 else 1 for s in matrix)
        return ChunkLayout(shape=shape, matrix_shape=matrix, chunk_shape=chunks)

    @property
    def chunk_elements(self) -> int:
        return math.prod(self.chunk_shape)

    @property
    def n_chunks(self) -> int:
        return math.prod(m // c for m, c in zip(self.matrix_shape, self.chunk_shape))

    @property
    def numel(self) -> int:
        return math.prod(self.matrix_shape)


def encode(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """DCT-II of every chunk of ``x``: returns ``(n_chunks, chunk_elements)``."""
    if len(layout.matrix_shape) == 1:
        (c,) = layout.chunk_shape
        d = dct_matrix(c, x.dtype, x.device)
        blocks = x.reshape(-1, c)  # (n_chunks, c)
        return blocks @ d.T  # (n_chunks, c)
    (rows, cols), (cr, cc) = layout.matrix_shape, layout.chunk_shape
    dr, dc = dct_matrix(cr, x.dtype, x.device), dct_matrix(cc, x.dtype, x.device)
    blocks = x.reshape(rows // cr, cr, cols // cc, cc).permute(0, 2, 1, 3)  # (R, C, cr, cc)
    coeffs = dr @ blocks @ dc.T  # (R, C, cr, cc)
    return coeffs.reshape(-1, cr * cc)  # (n_chunks, cr·cc)


def decode(coeffs: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Inverse of :func:`encode`: coefficients ``(n_chunks, chunk_elements)`` → ``shape``."""
    if len(layout.matrix_shape) == 1:
        (c,) = layout.chunk_shape
        d = dct_matrix(c, coeffs.dtype, coeffs.device)
        return (coeffs @ d).reshape(layout.shape)  # (n_chunks, c) → shape
    (rows, cols), (cr, cc) = layout.matrix_shape, layout.chunk_shape
    dr, dc = dct_matrix(cr, coeffs.dtype, coeffs.device), dct_matrix(cc, coeffs.dtype, coeffs.device)
    blocks = coeffs.reshape(rows // cr, cols // cc, cr, cc)  # (R, C, cr, cc)
    x = dr.T @ blocks @ dc  # (R, C, cr, cc)
    return x.permute(0, 2, 1, 3).reshape(layout.shape)


# -- stacks of chunks: many tensors with the same chunk shape transformed by one matmul pair.
# Every chunk is transformed independently (a batched matmul per chunk, a row block of one mm),
# so stacking tensors changes no bit of any chunk's coefficients.


def chunk_view(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``x`` (contiguous) seen as its chunks, ``(R, C, cr, cc)`` or ``(n_chunks, c)``, no copy.

    Chunk order is :func:`encode`'s (row-major over the chunk grid); writes go to ``x``.
    """
    if len(layout.matrix_shape) == 1:
        return x.view(-1, layout.chunk_shape[0])  # (n_chunks, c)
    (rows, cols), (cr, cc) = layout.matrix_shape, layout.chunk_shape
    return x.view(rows // cr, cr, cols // cc, cc).permute(0, 2, 1, 3)  # (R, C, cr, cc)


def encode_chunks(
    blocks: torch.Tensor, mid: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """DCT-II of a stack of chunks ``(N, c)`` or ``(N, cr, cc)``: returns ``(N, chunk_elements)``.

    ``mid`` (``blocks``' shape) and ``out`` (``(N, chunk_elements)``) are optional reusable
    buffers. The ops are exactly those ``dr @ blocks @ dc.T`` dispatches to (a batched matmul
    of the expanded left factor, then one matmul over all rows), so results match it bitwise.
    """
    if blocks.dim() == 2:
        d = dct_matrix(blocks.shape[1], blocks.dtype, blocks.device)
        return torch.mm(blocks, d.T, out=out)  # (N, c)
    n, cr, cc = blocks.shape
    dr, dc = dct_matrix(cr, blocks.dtype, blocks.device), dct_matrix(cc, blocks.dtype, blocks.device)
    left = torch.bmm(dr.expand(n, cr, cr), blocks, out=mid)  # (N, cr, cc)
    result = torch.mm(left.view(n * cr, cc), dc.T, out=None if out is None else out.view(n * cr, cc))
    return result.view(n, cr * cc)  # (N, cr·cc)


def decode_chunks(
    coeffs: torch.Tensor, chunk_shape: tuple[int, ...], mid: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`encode_chunks`: ``(N, chunk_elements)`` → ``(N, *chunk_shape)``.

    ``mid`` and ``out`` are optional reusable ``(N, *chunk_shape)`` buffers.
    """
    if len(chunk_shape) == 1:
        d = dct_matrix(chunk_shape[0], coeffs.dtype, coeffs.device)
        return torch.mm(coeffs, d, out=out)  # (N, c)
    cr, cc = chunk_shape
    n = coeffs.shape[0]
    dr, dc = dct_matrix(cr, coeffs.dtype, coeffs.device), dct_matrix(cc, coeffs.dtype, coeffs.device)
    left = torch.bmm(dr.T.expand(n, cr, cr), coeffs.view(n, cr, cc), out=mid)  # (N, cr, cc)
    result = torch.mm(left.view(n * cr, cc), dc, out=None if out is None else out.view(n * cr, cc))
    return result.view(n, cr, cc)  # (N, cr, cc)
