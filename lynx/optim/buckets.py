"""Bucketing, bit packing, wire-byte formulas and async collectives shared by the optimizers.

Both :class:`lynx.optim.DeMo` and :class:`lynx.optim.DistributedLion` derive from
:class:`BucketedOptimizer`: parameters are grouped into buckets (in reverse registration
order, the order backward produces gradients, like DDP), each bucket's payload is packed
into one or two flat tensors and sent by one or two asynchronous collectives. The runtime
may call :meth:`BucketedOptimizer.launch` per bucket as soon as its gradients are ready and
:meth:`BucketedOptimizer.finish` at the end; :meth:`~BucketedOptimizer.step` does both.

Wire bytes are counted from the payload tensors actually sent, with the standard formulas
(per rank, each direction): ring all-reduce ``2(W−1)/W·n``, all-gather ``(W−1)·n`` (``n`` the
per-rank payload), all-to-all the bytes of the splits that leave (arrive at) this rank.

Example::

    >>> import torch
    >>> from lynx.optim.buckets import pack_bits, unpack_bits, ring_all_reduce_bytes
    >>> packed = pack_bits(torch.tensor([5, 0, 7, 2]), bits=3)   # 12 bits → 2 bytes
    >>> packed.numel(), unpack_bits(packed, bits=3, count=4).tolist()
    (2, [5, 0, 7, 2])
    >>> ring_all_reduce_bytes(1000, world_size=8)
    1750.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from lynx.errors import LynxConfigError, LynxRuntimeError
from lynx.optim.bitpack import pack_bits, unpack_bits  # re-exported: the packers live in bitpack.py

__all__ = [
    "Comm",
    "BucketHandle",
    "BucketedOptimizer",
    "pack_bits",
    "unpack_bits",
    "bits_for",
    "smallest_int_dtype",
    "ring_all_reduce_bytes",
    "all_gather_bytes",
    "assign_buckets",
    "DEFAULT_BUCKET_BYTES",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # parameter bytes per bucket, DDP's default


def bits_for(count: int) -> int:
    """Bits needed to store the values ``0 .. count-1`` (at least 1)."""
    return max(1, math.ceil(math.log2(count))) if count > 1 else 1


def smallest_int_dtype(count: int) -> torch.dtype:
    """Smallest integer dtype that holds ``0 .. count-1``: uint8, int16, int32 or int64."""
    for dtype, limit in ((torch.uint8, 2**8), (torch.int16, 2**15), (torch.int32, 2**31)):
        if count <= limit:
            return dtype
    return torch.int64


def ring_all_reduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def all_gather_bytes(per_rank_bytes: float, world_size: int) -> float:
    """Bytes one rank sends (and receives) in an all-gather of ``per_rank_bytes`` each."""
    return float((world_size - 1) * per_rank_bytes)


def assign_buckets(numels_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of about ``bucket_bytes`` parameter bytes.

    Buckets are filled in reverse parameter order (backward's gradient order); a parameter
    larger than ``bucket_bytes`` gets a bucket of its own. Returns the indices per bucket.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(numels_bytes))):
        if current and size + numels_bytes[i] > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numels_bytes[i]
    if current:
        buckets.append(current)
    return buckets


@dataclass
class Comm:
    """The data-parallel group one optimizer talks over, and its per-step counters."""

    group: Any
    world_size: int
    rank: int
    sent: float = 0.0
    received: float = 0.0
    collectives: int = 0

    @staticmethod
    def resolve(process_group: Any) -> "Comm":
        if not dist.is_available() or not dist.is_initialized():
            if process_group is not None:
                raise LynxConfigError(
                    "a process_group was given but torch.distributed is not initialized; "
                    "call torch.distributed.init_process_group first (or pass process_group=None "
                    "for a single process)"
                )
            return Comm(group=None, world_size=1, rank=0)
        return Comm(
            group=process_group,
            world_size=dist.get_world_size(process_group),
            rank=dist.get_rank(process_group),
        )

    # Each wrapper looks the collective up on torch.distributed at call time (so tests can
    # count calls) and adds its wire bytes to this step's counters.
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        self.collectives += 1
        self.sent += all_gather_bytes(inp.nbytes, self.world_size)
        self.received += all_gather_bytes(inp.nbytes, self.world_size)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out.view(-1), inp.reshape(-1), group=self.group, async_op=True)  # (W·n,) ← (n,)

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        self.collectives += 1
        self.sent += ring_all_reduce_bytes(tensor.nbytes, self.world_size)
        self.received += ring_all_reduce_bytes(tensor.nbytes, self.world_size)
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> Any:
        self.collectives += 1
        item = inp.element_size()
        self.sent += item * sum(s for j, s in enumerate(in_splits) if j != self.rank)
        self.received += item * sum(s for j, s in enumerate(out_splits) if j != self.rank)
        return dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group, async_op=True
        )


@dataclass
class BucketHandle:
    """A bucket in flight: ``wait()`` completes its collectives and applies its update."""

    bucket: int
    finisher: Callable[[], None]
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            with torch.no_grad():
                self.finisher()
            self.done = True


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two exact integer checksums of a tensor's bytes (order-sensitive)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total, weighted = 0, 0
    step = 1 << 20
    for start in range(0, raw.numel(), step):
        piece = raw[start : start + step].to(torch.int64)
        pos = torch.arange(start, start + piece.numel(), dtype=torch.int64, device=piece.device) % 65521 + 1
        total += int(piece.sum())
        weighted += int((piece * pos).sum())
    return total, weighted


@dataclass
class _Bookkeeping:
    handles: dict[int, BucketHandle] = field(default_factory=dict)


class _GroupOf:
    """``group_of[i]``: the *current* param-group dict of parameter ``i``.

    It holds group indices, not dicts: ``load_state_dict`` replaces ``param_groups`` with new
    dicts, and a learning rate set on those afterwards must be the one used.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, index: list[int]):
        self._optimizer = optimizer
        self._index = index

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._optimizer.param_groups[self._index[i]]

    def __len__(self) -> int:
        return len(self._index)


class BucketedOptimizer(torch.optim.Optimizer):
    """Base of the communication-compressed optimizers: buckets, async handles, counters."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], process_group: Any, bucket_bytes: int):
        super().__init__(params, defaults)
        if bucket_bytes <= 0:
            raise LynxConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.comm = Comm.resolve(process_group)
        self.bucket_bytes = int(bucket_bytes)
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        group_index: list[int] = []
        for g, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                self._params.append(p)
                group_index.append(g)
                self._names.append(names[i] if names else f"param_groups[{g}]['params'][{i}] {tuple(p.shape)}")
        self._group_of = _GroupOf(self, group_index)  # looked up per use: survives load_state_dict
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.buckets: list[list[int]] = assign_buckets(
            [p.numel() * p.element_size() for p in self._params], self.bucket_bytes
        )
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._pending = _Bookkeeping()
        self.last_step_bytes: dict[str, float] = {"sent": 0.0, "received": 0.0}
        self.last_step_collectives = 0
        self._check_replicas()

    # ------------------------------------------------------------------ public API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "buckets"):
            # Buckets and payload layouts are fixed at construction, identically on every rank.
            raise LynxConfigError(
                f"{type(self).__name__}: parameter groups cannot be added after construction; "
                "pass every group to the constructor"
            )
        super().add_param_group(param_group)

    def bucket_of(self, param: torch.Tensor) -> int:
        """Index of the bucket ``param`` belongs to."""
        try:
            return self._bucket_of[self._index[id(param)]]
        except KeyError:
            raise LynxConfigError("bucket_of: this tensor is not a parameter of the optimizer") from None

    def launch(self, bucket: int) -> BucketHandle:
        """Start bucket ``bucket``'s collectives (its gradients must be final); returns a handle."""
        if not 0 <= bucket < len(self.buckets):
            raise LynxConfigError(f"bucket index {bucket} out of range: the optimizer has {len(self.buckets)} buckets")
        if bucket in self._pending.handles:
            return self._pending.handles[bucket]
        with torch.no_grad():
            handle = BucketHandle(bucket, self._launch_bucket(bucket))
        self._pending.handles[bucket] = handle
        return handle

    def finish(self) -> None:
        """Launch any bucket not yet launched, wait for all, apply the updates, close the step."""
        for b in range(len(self.buckets)):
            self.launch(b)
        with torch.no_grad():
            for b in range(len(self.buckets)):
                self._pending.handles[b].wait()
        self._pending.handles.clear()
        self.last_step_bytes = {"sent": self.comm.sent, "received": self.comm.received}
        self.last_step_collectives = self.comm.collectives
        self.comm.sent = self.comm.received = 0.0
        self.comm.collectives = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish()
        return loss

    # ------------------------------------------------------------------ for subclasses
    def _launch_bucket(self, bucket: int) -> Callable[[], None]:
        """Compute and send bucket ``bucket``'s payload; return the function that completes it."""
        raise NotImplementedError

    def _grad(self, i: int) -> torch.Tensor:
        p = self._params[i]
        # A parameter without a gradient contributes zeros, so every rank runs the same
        # collectives with the same payload layout.
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _check_replicas(self) -> None:
        """Parameters must start identical on every rank: compare exact checksums once."""
        if self.comm.world_size == 1 or not self._params:
            return
        # On the parameters' device: NCCL gathers only device tensors, gloo either.
        device = self._params[0].device
        local = torch.tensor([_checksum(p) for p in self._params], dtype=torch.int64, device=device)  # (n, 2)
        gathered = torch.empty((self.comm.world_size, *local.shape), dtype=torch.int64, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered.view(-1), local.view(-1), group=self.comm.group)
        differs = (gathered != gathered[0:1]).any(dim=2).any(dim=0)  # (n,)
        if bool(differs.any()):
            bad = [self._names[i] for i in differs.nonzero().flatten().tolist()]
            raise LynxRuntimeError(
                f"{type(self).__name__}: parameter(s) differ across the {self.comm.world_size} ranks at "
                f"start: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. Data-parallel replicas must "
                "start identical: seed the model the same way on every rank or broadcast rank 0's weights."
            )
