"""DeMo: decoupled momentum optimization (Peng, Quesnelle, Kingma, arXiv 2411.19870).

Each rank keeps its own momentum and per step, for every parameter ``p`` with gradient ``g``:

1. ``m ← decay·m + lr·g``;
2. ``C = DCT(m)`` chunk by chunk (orthonormal DCT-II, see :mod:`lynx.optim.dct`);
3. keep the ``k`` largest-magnitude coefficients of every chunk, rounded to ``value_dtype``;
4. error feedback: ``m ← m − IDCT(kept)`` — what was sent leaves the momentum;
5. all-gather every rank's indices and values; each coefficient becomes the mean over the
   ranks that sent it; ``u = IDCT(mean)``;
6. ``p ← p·(1 − lr·λ) − lr·sign(u)``.

The momentum of compressed tensors is held as its DCT coefficients (``state[p]["momentum_dct"]``,
``(chunks, chunk elements)``): steps 1–4 become ``M ← decay·M + lr·DCT(g)``, top-k of ``|M|``
(ties to the lower index), ``M[kept] −= round(M[kept])`` — the same algorithm, one transform
fewer and an exact error feedback (:mod:`lynx.optim.demo_batch`).

Tensors whose sparse payload would not be smaller than their dense form are sent dense:
their whole momentum is transmitted (``m ← 0``) and averaged with an all-reduce — DeMo with
``k`` = the whole chunk. Payload layout and wire bytes: :mod:`lynx.optim.demo_payload`.

Example (one process, no process group needed)::

    >>> import torch
    >>> from lynx.optim import DeMo
    >>> model = torch.nn.Linear(64, 64)
    >>> opt = DeMo(model.parameters(), lr=1e-3)
    >>> model(torch.randn(4, 64)).square().mean().backward()
    >>> opt.step()
    >>> opt.last_step_bytes      # a single process sends nothing
    {'sent': 0.0, 'received': 0.0}
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from lynx.errors import LynxConfigError
from lynx.optim.buckets import DEFAULT_BUCKET_BYTES, BucketedOptimizer
from lynx.optim.dct import chunk_view, encode
from lynx.optim.demo_batch import BucketKernel, from_grid
from lynx.optim.demo_payload import BucketPlan, plan_bucket
from lynx.torch_private import foreach_add_

__all__ = ["DeMo"]


class DeMo(BucketedOptimizer):
    """DeMo over a data-parallel process group, with bucketed, bit-packed payloads.

    Args:
        params: parameters, ``named_parameters()`` (names appear in errors) or param groups.
        lr: learning rate (also scales the gradient into the momentum, as in the paper).
        compression_decay: momentum decay ``β`` in ``[0, 1)``.
        compression_topk: coefficients sent per chunk.
        compression_chunk: target chunk side; each dimension is cut by its largest divisor
            not above it (matrices get 2-D chunks of up to ``chunk²`` elements).
        weight_decay: decoupled weight decay ``λ``.
        process_group: the data-parallel group; ``None`` = the default group, or a single
            process when torch.distributed is not initialized.
        value_dtype: dtype the coefficient values travel in.
        bucket_bytes: parameter bytes per bucket.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        process_group: Any = None,
        value_dtype: torch.dtype = torch.bfloat16,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        if not lr >= 0.0:
            raise LynxConfigError(f"DeMo: lr must be >= 0, got {lr}")
        if not 0.0 <= compression_decay < 1.0:
            raise LynxConfigError(f"DeMo: compression_decay must be in [0, 1), got {compression_decay}")
        if compression_chunk < 1:
            raise LynxConfigError(f"DeMo: compression_chunk must be >= 1, got {compression_chunk}")
        if not 1 <= compression_topk <= compression_chunk**2:
            raise LynxConfigError(
                f"DeMo: compression_topk={compression_topk} must be between 1 and the elements of a chunk "
                f"(compression_chunk²={compression_chunk**2}); lower compression_topk or raise compression_chunk"
            )
        if not weight_decay >= 0.0:
            raise LynxConfigError(f"DeMo: weight_decay must be >= 0, got {weight_decay}")
        if not (isinstance(value_dtype, torch.dtype) and value_dtype.is_floating_point):
            raise LynxConfigError(f"DeMo: value_dtype must be a floating torch.dtype, got {value_dtype!r}")
        defaults = dict(
            lr=lr,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            weight_decay=weight_decay,
        )
        self.value_dtype = value_dtype
        super().__init__(params, defaults, process_group, bucket_bytes)
        self._plans: list[BucketPlan] = []
        self._kernels: dict[tuple[int, str], BucketKernel] = {}
        self._views: dict[int, tuple[list, list[torch.Tensor | None]]] = {}  # bucket → (storage keys, views)
        for members in self.buckets:
            g = self._group_of[members[0]]
            settings = {
                (self._group_of[i]["compression_topk"], self._group_of[i]["compression_chunk"]) for i in members
            }
            if len(settings) > 1:
                raise LynxConfigError("DeMo: param groups sharing a bucket must share compression_topk/chunk")
            self._plans.append(
                plan_bucket(
                    [(tuple(self._params[i].shape), self._params[i].dtype) for i in members],
                    g["compression_topk"],
                    g["compression_chunk"],
                    value_dtype,
                )
            )

    def _momentum(self, i: int) -> torch.Tensor:
        """A dense member's momentum (parameter layout)."""
        state = self.state[self._params[i]]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(self._params[i], memory_format=torch.preserve_format)
        return state["momentum"]

    def _kernel(self, bucket: int, device: torch.device) -> BucketKernel:
        """The bucket's batched compute, tables and DCT-domain momenta, built once per device."""
        key = (bucket, str(device))
        kernel = self._kernels.get(key)
        if kernel is None:
            members = self.buckets[bucket]
            dtypes = [self._params[i].dtype for i in members]
            kernel = BucketKernel(self._plans[bucket], dtypes, self.value_dtype, device)
            self._kernels[key] = kernel
            self._adopt(bucket, kernel)
        return kernel

    def _adopt(self, bucket: int, kernel: BucketKernel) -> None:
        """Make each compressed member's ``state["momentum_dct"]`` the kernel's view of it.

        A value already in the state (loaded by ``load_state_dict``) is copied in first; a
        parameter-layout ``"momentum"`` (a checkpoint of an earlier version) is transformed.
        """
        for j, (i, tp) in enumerate(zip(self.buckets[bucket], self._plans[bucket].tensors)):
            if not tp.compressed:
                continue
            view = kernel.momentum_of(j)  # (n_chunks, E)
            state = self.state[self._params[i]]
            held = state.get("momentum_dct")
            if held is view:
                continue
            if held is not None:
                view.copy_(held.reshape(view.shape))
            elif "momentum" in state:
                view.copy_(encode(state.pop("momentum").to(view.dtype), tp.layout))
            else:
                view.zero_()
            state["momentum_dct"] = view

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as ``torch.optim.Optimizer`` does, then copy the momenta into the kernels' stacks."""
        super().load_state_dict(state_dict)
        for (bucket, _), kernel in self._kernels.items():
            self._adopt(bucket, kernel)

    def _param_views(self, bucket: int) -> list[torch.Tensor | None]:
        """Per member: its parameter as chunks (``chunk_view``), or None (dense or non-contiguous).

        Built once per bucket and rebuilt only when a parameter's storage changed.
        """
        members, plan = self.buckets[bucket], self._plans[bucket]
        ptrs = [(self._params[i].data_ptr(), self._params[i].stride()) for i in members]
        cached = self._views.get(bucket)
        if cached is None or cached[0] != ptrs:
            views = [
                chunk_view(self._params[i], tp.layout) if tp.compressed and self._params[i].is_contiguous() else None
                for i, tp in zip(members, plan.tensors)
            ]
            cached = self._views[bucket] = (ptrs, views)
        return cached[1]

    def _launch_bucket(self, bucket: int) -> Callable[[], None]:
        members, plan = self.buckets[bucket], self._plans[bucket]
        device = self._params[members[0]].device
        dense = torch.empty(plan.dense_numel, dtype=plan.dense_dtype, device=device)  # (D,)
        groups = [self._group_of[i] for i in members]
        settings = [(g["compression_decay"], g["lr"]) for g in groups]
        grads: list[torch.Tensor | None] = []
        for i, tp, group in zip(members, plan.tensors, groups):
            p = self._params[i]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # no gradient: zeros (same payload)
            if tp.compressed:
                grads.append(grad)
                continue
            m = self._momentum(i)
            m.mul_(group["compression_decay"]).add_(grad, alpha=group["lr"])
            dense[tp.dense_offset : tp.dense_offset + tp.numel].copy_(m.reshape(-1))
            m.zero_()  # all of it is transmitted
            grads.append(None)
        kernel = self._kernel(bucket, device)
        row = kernel.compress(grads, settings)  # (P,) momenta updated, error feedback applied
        world = self.comm.world_size
        gathered = row.unsqueeze(0)  # (W, P)
        works = []
        if world > 1 and plan.sparse_bytes:
            gathered = torch.empty((world, plan.sparse_bytes), dtype=torch.uint8, device=device)
            works.append(self.comm.all_gather(gathered, row))
        if world > 1 and plan.dense_numel:
            works.append(self.comm.all_reduce(dense))

        def complete() -> None:
            for w in works:
                w.wait()
            signs = kernel.decompress(gathered)  # sign(IDCT(mean)) per compressed member
            averaged = dense / world if plan.dense_numel else dense  # (D,)
            views = self._param_views(bucket)
            batched: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # lr → (params, signs)
            for j, (i, tp, group, view) in enumerate(zip(members, plan.tensors, groups, views)):
                p, lr = self._params[i], group["lr"]
                keep = 1.0 - lr * group["weight_decay"]
                if keep != 1.0:  # p·1.0 is p: skipping it changes no bit
                    p.mul_(keep)
                if view is not None:
                    pair = batched.get(lr)
                    if pair is None:
                        pair = batched[lr] = ([], [])
                    pair[0].append(view)
                    pair[1].append(signs[j])
                elif tp.compressed:
                    p.add_(from_grid(signs[j], tp.layout), alpha=-lr)
                else:
                    update = averaged[tp.dense_offset : tp.dense_offset + tp.numel].view(p.shape).to(p.dtype).sign()
                    p.add_(update, alpha=-lr)
            for lr, (params, updates) in batched.items():  # p.add_(sign, alpha=-lr) for each, in one call
                foreach_add_(params, updates, alpha=-lr)

        return complete
