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
from functools import lru_cache
from typing import Any, Callable, Iterable

import torch

from lynx.errors import LynxConfigError
from lynx.optim.bitpack import gather_flags
from lynx.optim.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketedOptimizer,
    all_gather_bytes,
    assign_buckets,
    pack_bits,
    ring_all_reduce_bytes,
    unpack_bits,
)

__all__ = ["DistributedLion", "lion_wire_bytes", "shard_splits", "majority_bits"]

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


def _alternate(parity: int) -> int:
    """Packed byte whose bit ``j`` is set iff ``(j + parity)`` is even: 0x55 or 0xAA."""
    return 0x55 if parity % 2 == 0 else 0xAA


@lru_cache(maxsize=8)
def _sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, 8)``: row ``b`` holds ``±1`` for the eight bits of byte ``b``, LSB first."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # (256, 8)
    return (bits * 2 - 1).to(dtype=dtype, device=device)


def majority_bits(ballots: torch.Tensor, tie: int = 0) -> torch.Tensor:
    """Bitwise majority of ``W`` packed vote rows ``(W, m)`` → ``(m,)`` packed result.

    Bit ``j`` of the result is set iff more than half the rows have it set; on an exact tie
    (even ``W``) it is bit ``j`` of the byte ``tie``. Counts are kept as bit planes (a
    ripple-carry adder on whole bytes), so the vote costs ``O(W·log W)`` byte-wide ops on
    ``m`` bytes, never one op per bit.
    """
    world = ballots.shape[0]
    planes: list[torch.Tensor] = []  # planes[i]: bit i of each position's count of set bits
    for r in range(world):
        carry = ballots[r]
        for i, plane in enumerate(planes):
            planes[i], carry = plane ^ carry, plane & carry
        if len(planes) < (r + 1).bit_length():
            planes.append(carry)
    half = world // 2
    above = torch.zeros_like(ballots[0])  # count > half, decided from the top bit down
    equal = torch.full_like(ballots[0], 0xFF)  # count == half so far
    for i in range(len(planes) - 1, -1, -1):
        if (half >> i) & 1:
            equal &= planes[i]
        else:
            above |= equal & planes[i]
            equal &= ~planes[i]
    if world % 2 == 0 and tie:
        above |= equal & tie
    return above


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
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, process_group, bucket_bytes)

    def _state(self, i: int) -> dict[str, torch.Tensor]:
        state = self.state[self._params[i]]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(self._params[i], memory_format=torch.preserve_format)
            state["step"] = torch.zeros((), dtype=torch.int64)
        return state

    def _signs(self, members: list[int], sign: bool = True) -> torch.Tensor:
        """Lion's ``β1·m + (1−β1)·g`` for a bucket, flat, and step the momenta.

        With ``sign`` the result is ``δ = sign(·)``; without, only its sign is meaningful (it is
        exact where the parameter's dtype is the bucket's, and already ``δ`` elsewhere).
        """
        params = [self._params[i] for i in members]
        dtype = params[0].dtype
        for p in params[1:]:
            dtype = torch.promote_types(dtype, p.dtype)  # what torch.cat of the signs gives
        delta = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)  # (N,)
        offset = 0
        for i, p in zip(members, params):
            state, grad = self._state(i), self._grad(i)
            beta1, beta2 = self._group_of[i]["betas"]
            m, n = state["exp_avg"], p.numel()
            out = delta[offset : offset + n].view(p.shape)
            if m.dtype == dtype:
                torch.mul(m, beta1, out=out).add_(grad, alpha=1 - beta1)  # signed below, all at once
            else:  # computed in the parameter's own dtype, as Lion does
                out.copy_(m.mul(beta1).add_(grad, alpha=1 - beta1).sign_())
            m.mul_(beta2).add_(grad, alpha=1 - beta2)
            state["step"] += 1
            offset += n
        return delta.sign_() if sign else delta  # (N,)

    def _launch_bucket(self, bucket: int) -> Callable[[], None]:
        members = self.buckets[bucket]
        step = int(self._state(members[0])["step"])
        world = self.comm.world_size
        if world > 1 and self.mode == "mavo":
            return self._launch_mavo(members, self._signs(members, sign=False), step)
        delta = self._signs(members)  # (N,) in {-1, 0, 1}
        if world == 1:
            return lambda: self._apply(members, delta)
        return self._launch_avg(members, delta)

    def _apply(self, members: list[int], update: torch.Tensor) -> None:
        offset = 0
        for i in members:
            p, group = self._params[i], self._group_of[i]
            n = p.numel()
            keep = 1 - group["lr"] * group["weight_decay"]
            if keep != 1.0:  # p·1.0 is p: skipping it changes no bit
                p.mul_(keep)
            p.add_(update[offset : offset + n].view(p.shape).to(p.dtype), alpha=-group["lr"])
            offset += n

    def _launch_mavo(self, members: list[int], signal: torch.Tensor, step: int) -> Callable[[], None]:
        """Majority vote on packed bits; ``signal`` has the sign of each rank's δ."""
        world, rank, n, device = self.comm.world_size, self.comm.rank, signal.numel(), signal.device
        flags = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.bool, device=device)  # (8·ceil(N/8),)
        torch.gt(signal, 0, out=flags[:n])
        votes = gather_flags(flags.view(torch.uint8))  # (ceil(N/8),) δ = +1
        torch.eq(signal, 0, out=flags[:n])
        zeros = gather_flags(flags.view(torch.uint8))  # δ = 0
        # An exact zero votes by alternation: +1 iff (j + step + rank) is even (bytes start at even j).
        votes |= zeros & _alternate(step + rank)
        splits = shard_splits(votes.numel(), world)
        mine, widest = splits[rank], max(splits)
        received = torch.empty(world * mine, dtype=torch.uint8, device=device)  # (W·s_r,)
        work = self.comm.all_to_all(received, votes, in_splits=splits, out_splits=[mine] * world)
        state: dict[str, Any] = {}

        def vote() -> None:
            work.wait()
            start = sum(splits[:rank])  # first byte of my shard
            bits = min(mine * 8, max(0, n - start * 8))  # valid bits in my shard
            ballots = received.view(world, mine)  # (W, s_r) packed votes
            # A tie (Σδ = 0, even W) goes to +1 iff (j + step) is even.
            result = majority_bits(ballots, tie=_alternate(step) if world % 2 == 0 else 0)  # (s_r,)
            if bits < mine * 8:  # bits past the bucket's end stay zero, as the packer leaves them
                result[bits // 8] &= (1 << (bits % 8)) - 1
            shard = torch.zeros(widest, dtype=torch.uint8, device=device)  # (max s,)
            shard[:mine] = result
            everyone = torch.empty((world, widest), dtype=torch.uint8, device=device)
            state["work"] = self.comm.all_gather(everyone, shard)
            state["everyone"] = everyone

        def complete() -> None:
            if "work" not in state:
                vote()
            state["work"].wait()
            everyone = state["everyone"]
            if all(s == widest for s in splits):
                packed = everyone.view(-1)  # (ceil(N/8),)
            else:
                packed = torch.cat([everyone[r, : splits[r]] for r in range(world)])  # (ceil(N/8),)
            update = _sign_table(signal.dtype, device).index_select(0, packed.to(torch.int32))  # (ceil(N/8), 8)
            self._apply(members, update.view(-1)[:n])  # (N,) in {-1, 1}

        # The vote and the second collective start as soon as the first one lands, when the
        # caller waits on this bucket; finish() waits on buckets in order, so every rank
        # issues the collectives in the same order.
        return complete

    def _launch_avg(self, members: list[int], delta: torch.Tensor) -> Callable[[], None]:
        world, n = self.comm.world_size, delta.numel()
        if _avg_uses_gather(world, self.avg_gather_below):
            codes = pack_bits((delta + 1).to(torch.uint8), bits=2)  # (ceil(N/4),) δ+1 ∈ {0, 1, 2}
            gathered = torch.empty((world, codes.numel()), dtype=torch.uint8, device=delta.device)
            work = self.comm.all_gather(gathered, codes)

            def complete_gather() -> None:
                work.wait()
                codes_all = unpack_bits(gathered, bits=2, count=n, dtype=torch.uint8)  # (W, N)
                total = codes_all.sum(dim=0, dtype=torch.int32) - world  # (N,) Σδ
                self._apply(members, total.to(delta.dtype) / world)

            return complete_gather
        counts = delta.to(torch.int8 if world <= 127 else torch.int16)  # (N,)
        work = self.comm.all_reduce(counts)

        def complete_reduce() -> None:
            work.wait()
            self._apply(members, counts.to(delta.dtype) / world)

        return complete_reduce
