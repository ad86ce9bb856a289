"""Reproducible token batches for pipeline runs: every microbatch from its own seeded generator.

A step's batch is what :meth:`lynx.runtime.Pipeline.step` takes: ``dp × microbatches × batch``
rows, replica-major (replica ``d`` trains rows ``[d·m·b, (d+1)·m·b)``), each microbatch
drawn from a generator seeded by ``(seed, step, replica, microbatch)``, so a reference can
rebuild any one microbatch alone (:meth:`TokenBatches.microbatch`).

Example::

    >>> batches = TokenBatches(vocab=16, batch=2, seq=4, seed=1)
    >>> idx, targets = batches(step=0, dp=2, microbatches=2)
    >>> bool((idx[6:8] == batches.microbatch(0, dp_rank=1, index=1)[0]).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenBatches"]


@dataclass(frozen=True)
class TokenBatches:
    """Random tokens and next-token targets (``idx.roll(-1)``), per (step, replica, microbatch)."""

    vocab: int
    batch: int          # rows per microbatch
    seq: int
    seed: int = 0

    def microbatch(self, step: int, dp_rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One microbatch: ``(idx, targets)``, each ``(batch, seq)``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + dp_rank * 101 + index)
        idx = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)  # (b, T)
        return idx, idx.roll(-1, dims=1)

    def __call__(self, step: int, dp: int, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole job's batch of one step: ``(idx, targets)``, each ``(dp·m·batch, seq)``."""
        parts = [self.microbatch(step, d, j) for d in range(dp) for j in range(microbatches)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
