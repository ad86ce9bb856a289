"""fp32 rounding bounds for the chunked DCT, for tests that compare differently batched kernels.

A BLAS may sum a dot product in any order (blocking, threads and SIMD width depend on the
matrix shape, the thread count and the CPU), so two computations of the same chunk's DCT —
one tensor at a time, or a stack of many — agree only to within rounding. The standard bound
(Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1) holds for every order: a
computed dot product of length ``n`` is within ``γ_n · Σ|x_i||y_i|`` of the exact one, with
``γ_n = n·u / (1 − n·u)`` and ``u = 2⁻²⁴`` for fp32. A chunk's DCT is two such products in a row
(``Dr @ X`` over ``cr`` terms, then ``@ Dcᵀ`` over ``cc``), so it is within
``γ_{cr+cc} · |Dr| |X| |Dc|ᵀ`` of the exact transform (``γ_a + γ_b + γ_a·γ_b ≤ γ_{a+b}``).
The "exact" side is computed here in float64 from the same fp32 DCT matrices; its own error
(``γ_n`` with ``u = 2⁻⁵³``) is added to every bound.

Example::

    >>> import torch
    >>> from lynx.optim.dct import ChunkLayout, encode
    >>> layout = ChunkLayout.for_shape((64, 96), chunk=32)
    >>> x = torch.randn(64, 96)
    >>> exact, bound = exact_encode(x, layout), encode_bound(x, layout)
    >>> bool(((encode(x, layout).double() - exact).abs() <= bound).all())
    True
"""

from __future__ import annotations

import torch

from lynx.optim.dct import ChunkLayout, dct_matrix

__all__ = ["U32", "U64", "gamma", "exact_encode", "exact_decode", "encode_bound", "decode_bound", "terms"]

U32 = 2.0**-24  # unit roundoff of fp32
U64 = 2.0**-53  # unit roundoff of float64


def gamma(n: int, u: float = U32) -> float:
    """Higham's ``γ_n``: the relative error bound of ``n`` rounded operations in a row."""
    assert n * u < 1
    return n * u / (1 - n * u)


def terms(layout: ChunkLayout) -> int:
    """Products summed in a row per DCT coefficient: ``c`` for 1-D chunks, ``cr + cc`` for 2-D."""
    return sum(layout.chunk_shape)


def _matrices(layout: ChunkLayout, absolute: bool) -> list[torch.Tensor]:
    mats = [dct_matrix(c, torch.float32).double() for c in layout.chunk_shape]  # the fp32 matrices, exactly
    return [m.abs() for m in mats] if absolute else mats


def _forward(x: torch.Tensor, layout: ChunkLayout, mats: list[torch.Tensor]) -> torch.Tensor:
    """:func:`lynx.optim.dct.encode` in float64 with given matrices: ``(n_chunks, chunk_elements)``."""
    if len(layout.matrix_shape) == 1:
        (c,) = layout.chunk_shape
        return x.reshape(-1, c) @ mats[0].T  # (n_chunks, c)
    (rows, cols), (cr, cc) = layout.matrix_shape, layout.chunk_shape
    blocks = x.reshape(rows // cr, cr, cols // cc, cc).permute(0, 2, 1, 3)  # (R, C, cr, cc)
    return (mats[0] @ blocks @ mats[1].T).reshape(-1, cr * cc)  # (n_chunks, cr·cc)


def _inverse(coeffs: torch.Tensor, layout: ChunkLayout, mats: list[torch.Tensor]) -> torch.Tensor:
    """:func:`lynx.optim.dct.decode` in float64 with given matrices: a tensor of ``layout.shape``."""
    if len(layout.matrix_shape) == 1:
        return (coeffs @ mats[0]).reshape(layout.shape)
    (rows, cols), (cr, cc) = layout.matrix_shape, layout.chunk_shape
    blocks = coeffs.reshape(rows // cr, cols // cc, cr, cc)  # (R, C, cr, cc)
    return (mats[0].T @ blocks @ mats[1]).permute(0, 2, 1, 3).reshape(layout.shape)


def exact_encode(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The DCT the fp32 kernels approximate, in float64: ``(n_chunks, chunk_elements)``."""
    return _forward(x.double(), layout, _matrices(layout, absolute=False))


def exact_decode(coeffs: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The inverse DCT the fp32 kernels approximate, in float64: ``layout.shape``."""
    return _inverse(coeffs.double(), layout, _matrices(layout, absolute=False))


def encode_bound(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Per coefficient, how far any fp32 :func:`encode` (any order) may be from :func:`exact_encode`."""
    n = terms(layout)
    magnitude = _forward(x.double().abs(), layout, _matrices(layout, absolute=True))  # |Dr||X||Dc|ᵀ
    return (gamma(n) + gamma(n + 2, U64)) * magnitude


def decode_bound(coeffs: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Per element, how far any fp32 :func:`decode` (any order) may be from :func:`exact_decode`."""
    n = terms(layout)
    magnitude = _inverse(coeffs.double().abs(), layout, _matrices(layout, absolute=True))
    return (gamma(n) + gamma(n + 2, U64)) * magnitude

