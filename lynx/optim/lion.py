"""Distributed Lion (Liu et al., arXiv 2404.00438): ranks exchange only Lion's sign updates.

Every rank runs Lion (Chen et al. 2023) on its own gradient and momentum::

    δ = sign(β1·m + (1−β1)·g)        m ← β2·m + (1−β2)·g        p ← p·(1 − lr·λ) − lr·Δ

and the ranks agree on ``Δ``:

- ``mode="mavo"`` (majority vote): ``Δ = sign(Σ_r δ_r)``, one bit per parameter each way
  whatever the world size ``W``. Each bucket's votes are packed 8 per byte; an
  ``all_to_all`` hands rank ``r`` everyone's bits of shard ``r``; rank ``r`` counts the votes
  of its shard and packs the result; an ``all_gather`` returns every shard's result.
  One bit cannot say "zero", so two conventions (documented, tested) make the vote binary:
  an exactly-zero ``δ`` (zero gradient and momentum, e.g. an unused embedding row) is cast
  as ``+1`` on rank ``r`` iff ``(j + t + r)`` is even, and a tie (``Σδ = 0``, even ``W``)
  resolves to ``+1`` iff ``(j + t)`` is even (``j`` the element's index in its bucket, ``t``
  the step). A parameter with no evidence therefore alternates ``±lr`` from step to step
  and does not drift, where Lion would leave it still.
- ``mode="avg"``: ``Δ = Σ_r δ_r / W``, exact. Sent as 2-bit codes ``δ+1`` by all-gather when
  ``W < 8`` (``(W−1)·N/4`` bytes per rank) and as an int8 all-reduce of ``δ`` otherwise
  (``2(W−1)/W·N`` bytes); the cheaper of the two for the world size.

At ``W = 1`` nothing is sent and ``Δ = δ``: exactly Lion, ``sign(0) = 0`` included.

Example::

    >>> import torch
    >>> from lynx.optim import DistributedLion
    >>> model = torch.nn.Linear(16, 4)
    >>> opt = DistributedLion(model.named_parameters(), lr=1e-4, mode="mavo")
    >>> model(torch.randn(3, 16)).sum().backward()
    >>> opt.step()
    >>> opt.last_step_collectives          # a single process sends nothing
    0
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from lynx.errors import LynxConfigError
from lynx.optim.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketedOptimizer,
    all_gather_bytes,
    assign_buckets,
    pack_bits,
    ring_all_reduce_bytes,
    unpack_bits,
)

__all__ = ["DistributedLion", "lion_wire_bytes", "shard_splits"]

MODES = ("mavo", "avg")


def shard_splits(nbytes: int, world_size: int) -> list[int]:
    """Bytes of each rank's shard of an ``nbytes`` packed vote vector (sizes differ by ≤ 1)."""
    base, rem = divmod(nbytes, world_size)
    return [base + (1 if r < rem else 0) for r in range(world_size)]


AVG_GATHER_BELOW = 8  # all-gather of 2-bit codes: (W−1)·N/4 bytes; int8 all-reduce: 2(W−1)/W·N


def _avg_uses_gather(world_size: int, below: int = AVG_GATHER_BELOW) -> bool:
    return world_size < below


def lion_wire_bytes(
    numels: list[int], world_size: int, mode: str = "mavo", *, rank: int = 0, elem_bytes: int = 4,
    bucket_bytes: int | None = None, avg_gather_below: int = AVG_GATHER_BELOW,
) -> dict[str, float]:
    """Analytic per-rank wire bytes of one DistributedLion step (same bucketing and formats)."""
    buckets = assign_buckets([n * elem_bytes for n in numels], bucket_bytes or DEFAULT_BUCKET_BYTES)
    sent = received = 0.0
    collectives = 0
    if world_size == 1:
        return {"sent": 0.0, "received": 0.0, "collectives": 0, "buckets": len(buckets)}
    for members in buckets:
        n = sum(numels[i] for i in members)
        if mode == "mavo":
            splits = shard_splits(math.ceil(n / 8), world_size)
            sent += sum(s for j, s in enumerate(splits) if j != rank) + all_gather_bytes(max(splits), world_size)
            received += (world_size - 1) * splits[rank] + all_gather_bytes(max(splits), world_size)
            collectives += 2
        elif _avg_uses_gather(world_size, avg_gather_below):
            sent += all_gather_bytes(math.ceil(n / 4), world_size)
            received += all_gather_bytes(math.ceil(n / 4), world_size)
            collectives += 1
        else:
            item = 1 if world_size <= 127 else 2
            sent += ring_all_reduce_bytes(n * item, world_size)
            received += ring_all_reduce_bytes(n * item, world_size)
            collectives += 1
    return {"sent": sent, "received": received, "collectives": collectives, "buckets": len(buckets)}


class DistributedLion(BucketedOptimizer):
    """Lion with a majority-vote (1 bit each way) or averaged update across ranks.

    Args:
        params: parameters, ``named_parameters()`` (names appear in errors) or param groups.
        lr: learning rate, ``>= 0``.
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        weight_decay: decoupled weight decay ``λ``.
        mode: ``"mavo"`` (majority vote) or ``"avg"`` (average of the signs).
        process_group: the data-parallel group (``None``: default group, or single process).
        bucket_bytes: parameter bytes per bucket.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        mode: str = "mavo",
        process_group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        if not lr >= 0.0:
            raise LynxConfigError(f"DistributedLion: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise LynxConfigError(f"DistributedLion: betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise LynxConfigError(f"DistributedLion: weight_decay must be >= 0, got {weight_decay}")
        if mode not in MODES:
            raise LynxConfigError(f"DistributedLion: unknown mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode = mode
        self.avg_gather_below = AVG_GATHER_BELOW  # "avg": all-gather codes below this W, else all-reduce
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), process_group, bucket_bytes)

    def _state(self, i: int) -> dict[str, torch.Tensor]:
        state = self.state[self._params[i]]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(self._params[i], memory_format=torch.preserve_format)
            state["step"] = torch.zeros((), dtype=torch.int64)
        return state

    def _launch_bucket(self, bucket: int) -> Callable[[], None]:
        members = self.buckets[bucket]
        signs = []
        step = int(self._state(members[0])["step"])
        for i in members:
            state, grad = self._state(i), self._grad(i)
            beta1, beta2 = self._group_of[i]["betas"]
            m = state["exp_avg"]
            signs.append(m.mul(beta1).add_(grad, alpha=1 - beta1).sign_().reshape(-1))
            m.mul_(beta2).add_(grad, alpha=1 - beta2)
            state["step"] += 1
        delta = torch.cat(signs)  # (N,) in {-1, 0, 1}
        world = self.comm.world_size
        if world == 1:
            return lambda: self._apply(members, delta)
        if self.mode == "mavo":
            return self._launch_mavo(members, delta, step)
        return self._launch_avg(members, delta)

    def _apply(self, members: list[int], update: torch.Tensor) -> None:
        offset = 0
        for i in members:
            p, group = self._params[i], self._group_of[i]
            n = p.numel()
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update[offset : offset + n].reshape(p.shape).to(p.dtype), alpha=-group["lr"])
            offset += n

    def _launch_mavo(self, members: list[int], delta: torch.Tensor, step: int) -> Callable[[], None]:
        world, rank, n = self.comm.world_size, self.comm.rank, delta.numel()
        index = torch.arange(n, device=delta.device)
        zero_vote = (index + step + rank) % 2 == 0  # an exact zero votes by alternation
        votes = pack_bits(torch.where(delta == 0, zero_vote, delta > 0), bits=1)  # (ceil(N/8),)
        splits = shard_splits(votes.numel(), world)
        mine = splits[rank]
        received = torch.empty(world * mine, dtype=torch.uint8, device=delta.device)  # (W·s_r,)
        work = self.comm.all_to_all(received, votes, in_splits=splits, out_splits=[mine] * world)
        state: dict[str, Any] = {}

        def vote() -> None:
            work.wait()
            start = sum(splits[:rank])  # first byte of my shard
            bits = min(mine * 8, max(0, n - start * 8))  # valid bits in my shard
            ballots = unpack_bits(received.reshape(world, mine), bits=1, count=bits)  # (W, bits)
            total = 2 * ballots.sum(dim=0) - world  # Σδ over ranks, (bits,)
            tie_up = (torch.arange(bits, device=delta.device) + start * 8 + step) % 2 == 0
            result = torch.where(total == 0, tie_up, total > 0)  # (bits,)
            shard = torch.zeros(max(splits), dtype=torch.uint8, device=delta.device)
            shard[:mine] = pack_bits(result, bits=1)[:mine]
            everyone = torch.empty((world, max(splits)), dtype=torch.uint8, device=delta.device)
            state["work"] = self.comm.all_gather(everyone, shard)
            state["everyone"] = everyone

        def complete() -> None:
            if "work" not in state:
                vote()
            state["work"].wait()
            everyone = state["everyone"]
            packed = torch.cat([everyone[r, : splits[r]] for r in range(world)])  # (ceil(N/8),)
            update = unpack_bits(packed, bits=1, count=n) * 2 - 1  # (N,) in {-1, 1}
            self._apply(members, update)

        # The vote and the second collective start as soon as the first one lands, when the
        # caller waits on this bucket; finish() waits on buckets in order, so every rank
        # issues the collectives in the same order.
        return complete

    def _launch_avg(self, members: list[int], delta: torch.Tensor) -> Callable[[], None]:
        world, n = self.comm.world_size, delta.numel()
        if _avg_uses_gather(world, self.avg_gather_below):
            codes = pack_bits((delta + 1).to(torch.int64), bits=2)  # (ceil(N/4),)
            gathered = torch.empty((world, codes.numel()), dtype=torch.uint8, device=delta.device)
            work = self.comm.all_gather(gathered, codes)

            def complete_gather() -> None:
                work.wait()
                total = (unpack_bits(gathered, bits=2, count=n) - 1).sum(dim=0)  # (N,) Σδ
                self._apply(members, total.to(delta.dtype) / world)

            return complete_gather
        counts = delta.to(torch.int8 if world <= 127 else torch.int16)  # (N,)
        work = self.comm.all_reduce(counts)

        def complete_reduce() -> None:
            work.wait()
            self._apply(members, counts.to(delta.dtype) / world)

        return complete_reduce
