"""What CUDA kernels save for backward, reproduced on fake CPU tensors (for a ``cuda`` profile).

Fake CUDA tensors cannot run on a CPU-only torch build, and what autograd saves differs by
device: CUDA's fused dropout saves a 1-byte mask where the CPU path saves a tensor of the
input's dtype, flash attention saves no s×s matrix, the fused RMSNorm a float32 ``rstd`` per
row. :data:`CUDA_EMULATED_OPS` maps each such op to a small autograd function that saves
exactly what the CUDA kernel saves; :func:`lynx.frontend.profile.profile` runs them for a
``cuda`` target.

Example::

    >>> import torch
    >>> from lynx.frontend.cuda_saves import CUDA_EMULATED_OPS
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> y = CUDA_EMULATED_OPS[torch.ops.aten.dropout.default](x, 0.1, True)
    >>> [t.dtype for t in y.grad_fn.saved_tensors]   # the mask, one byte an element
    [torch.bool]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CUDA_EMULATED_OPS"]


class _CudaDropout(torch.autograd.Function):
    """``native_dropout`` on CUDA: saves a 1-byte mask."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never run
        return grad


class _CudaFlashAttention(torch.autograd.Function):
    """Fused attention on CUDA: saves q, k, v, the output, logsumexp, RNG.

    The output takes q's layout, as cuDNN attention (the H200's choice) does: a (B, S, H, D)
    storage where q's heads are inner to its sequence (q viewed out of one projection, whose
    ``transpose(1, 2).reshape`` back is then free), else contiguous (B, H, S, D), whose reshape
    back to (B, S, C) copies. Both checked on an H200 against what the compiled stage holds, for
    a GPT (q split from the qkv projection) and a Llama (q made contiguous by the rotary
    embedding): ``benchmarks/results/gpu_check_rerun.md``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, S, D = q.shape
        if q.stride(1) < q.stride(2):  # heads inner to the sequence: a (B, S, H, D) layout
            out = torch.empty(B, S, H, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)  # (B, H, S, D)
        else:
            out = torch.empty(B, H, S, v.shape[-1], dtype=q.dtype, device=q.device)  # (B, H, S, D)
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)  # (B, H, S)
        rng_state = torch.empty(2, dtype=torch.int64, device=q.device)  # philox seed and offset
        ctx.save_for_backward(q, k, v, out, lse, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # pragma: no cover - never run
        return grad, grad, grad


class _CudaFusedRMSNorm(torch.autograd.Function):
    """``rms_norm`` on CUDA (``_fused_rms_norm``): saves the input and a float32 ``rstd`` per
    normalised row, where the composite the CPU runs keeps float32 copies of the rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int) -> torch.Tensor:
        rstd = torch.empty(*x.shape[:x.dim() - dims], *[1] * dims, dtype=torch.float32, device=x.device)  # (B, T, 1)
        ctx.save_for_backward(x, rstd, *([weight] if weight is not None else []))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # pragma: no cover - never run
        return grad, None, None


def _emulate_rms_norm(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                      eps: float | None = None) -> torch.Tensor:
    return _CudaFusedRMSNorm.apply(x, weight, len(normalized_shape))


def _emulate_dropout(x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    if not train or p == 0.0:
        return x
    return _CudaDropout.apply(x)


def _emulate_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return _CudaFlashAttention.apply(q, k, v)


#: Ops whose saved tensors on a CUDA target differ from what they save on the machine at hand.
CUDA_EMULATED_OPS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.dropout.default: _emulate_dropout,
    torch.ops.aten.scaled_dot_product_attention.default: _emulate_sdpa,
    torch.ops.aten.rms_norm.default: _emulate_rms_norm,
}
