"""Data-parallel gradient synchronisation per bucket, launched while backward still runs.

During the last microbatch's backward a post-accumulate-grad hook counts, per bucket, the
parameters whose gradient is final; when a bucket is complete its collective is launched
asynchronously, so the backward of earlier layers — and the on-demand recomputation it
triggers — overlaps the communication. The sync object is either :class:`AllReduceSync`
(mean of gradients over the data-parallel group, for AdamW or any local optimizer) or one of
Lynx's compressed optimizers (:class:`lynx.optim.DeMo`, :class:`lynx.optim.DistributedLion`),
which expose the same ``bucket_of`` / ``launch`` / ``finish`` interface: :class:`BucketedSync`;
:func:`syncs_own_buckets` is the one test of whether an object has it.

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(4, 4)
    >>> sync = AllReduceSync(list(lin.parameters()), group=None, bucket_bytes=64)
    >>> len(sync.buckets), syncs_own_buckets(sync), syncs_own_buckets(torch.optim.SGD(lin.parameters()))
    (2, True, False)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeGuard

import time

import torch
import torch.distributed as dist

from lynx.errors import LynxConfigError

__all__ = ["BucketedSync", "syncs_own_buckets", "AllReduceSync", "BucketLauncher"]


class BucketedSync(Protocol):
    """What syncs gradients over the data-parallel group bucket by bucket: :class:`AllReduceSync`,
    and the optimizers that sync their own buckets (``lynx.optim.DeMo``, ``DistributedLion``)."""

    def bucket_of(self, param: torch.Tensor) -> int:
        """The bucket ``param``'s gradient belongs to."""
        ...

    def launch(self, bucket: int) -> Any:
        """Start bucket ``bucket``'s collective (its gradients are final); idempotent."""
        ...

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and apply the result."""
        ...


def syncs_own_buckets(x: object) -> TypeGuard[BucketedSync]:
    """Whether ``x`` has :class:`BucketedSync`'s methods, looked up as attribute access does:
    duck typing is the contract, and a wrapper that forwards them (``__getattr__``) counts."""
    return all(hasattr(x, name) for name in ("bucket_of", "launch", "finish"))


class AllReduceSync:
    """Average gradients over ``group`` with one asynchronous all-reduce per bucket."""

    def __init__(self, params: Sequence[torch.Tensor], group: Any, bucket_bytes: int = 1 << 20) -> None:
        if bucket_bytes <= 0:
            raise LynxConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.params = list(params)
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() and group is not None else 1
        self.buckets: list[list[int]] = []
        size = bucket_bytes
        for i, p in enumerate(self.params):  # params in backward order: first ready first
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (size + nbytes > bucket_bytes and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self._bucket_of = {id(self.params[i]): b for b, members in enumerate(self.buckets) for i in members}
        self._pending: dict[int, tuple[Any, torch.Tensor]] = {}
        self.sent_bytes = 0

    def bucket_of(self, param: torch.Tensor) -> int:
        return self._bucket_of[id(param)]

    def launch(self, bucket: int) -> Any:
        if bucket in self._pending:
            return self._pending[bucket][0]
        grads = [self._grad(i) for i in self.buckets[bucket]]
        flat = torch.cat([g.reshape(-1) for g in grads])  # (n,)
        work = dist.all_reduce(flat, group=self.group, async_op=True) if self.world > 1 else None
        self.sent_bytes += flat.numel() * flat.element_size()
        self._pending[bucket] = (work, flat)
        return work

    def pending(self) -> list[tuple[int, Any]]:
        return [(b, w) for b, (w, _) in self._pending.items()]

    def finish(self, wait: Any = None) -> None:
        """Launch what is left, wait (through ``wait(work, what)`` when given), write back means."""
        for b in range(len(self.buckets)):
            self.launch(b)
        for b in range(len(self.buckets)):
            work, flat = self._pending.pop(b)
            if work is not None:
                wait(work, f"data-parallel all-reduce of bucket {b}") if wait else work.wait()
            if self.world > 1:
                flat.div_(self.world)
            offset = 0
            for i in self.buckets[b]:
                p = self.params[i]
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone() if p.grad is None else p.grad.copy_(
                    flat[offset:offset + n].view_as(p))
                offset += n

    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad if p.grad is not None else torch.zeros_like(p)


class BucketLauncher:
    """Launches ``sync``'s buckets as their gradients become final in the last backward."""

    def __init__(self, sync: BucketedSync, params: Sequence[torch.Tensor],
                 hold_buckets: frozenset[int] | set[int] = frozenset()) -> None:
        self.sync = sync
        self.armed = False
        members: dict[int, int] = {}
        self._bucket: dict[int, int] = {}
        for p in params:
            if not p.requires_grad:
                continue
            b = sync.bucket_of(p)
            self._bucket[id(p)] = b
            members[b] = members.get(b, 0) + 1
        for b in hold_buckets:  # never complete here: the caller launches them itself
            members[b] = members.get(b, 0) + (1 << 30)
        self._members = members
        self._remaining: dict[int, int] = {}
        self._final: set[int] = set()   # parameters counted since the counts were reset
        self.launch_times: list[float] = []
        self.hooks_muted = False   # see mute_hooks
        self._handles = [p.register_post_accumulate_grad_hook(self._on_hook) for p in params if p.requires_grad]

    def arm(self, reset: bool = True) -> None:
        """The next backward is the last one of the step: launch buckets as they complete.
        ``reset=False`` keeps the counts of an earlier arming in the same step (a rank whose
        chunks' gradients become final in different actions)."""
        self.armed = True
        if reset or not self._remaining:
            self._remaining = dict(self._members)
            self._final = set()

    def reset(self) -> None:
        """A new step: no gradient is final yet."""
        self._remaining = {}
        self._final = set()

    def param_ready(self, param: torch.Tensor) -> None:
        """``param.grad`` is final for this backward (a compiled stage's backward graph calls this)."""
        self._on_grad(param)

    @contextmanager
    def mute_hooks(self) -> Iterator[None]:
        """Count only what the backward graphs hand over (:meth:`param_ready`), not autograd's
        hooks: a split backward's input part returns no gradient for the weights its weight part
        computes later, and autograd runs their hooks all the same, before they are final."""
        self.hooks_muted = True
        try:
            yield
        finally:
            self.hooks_muted = False

    def _on_hook(self, param: torch.Tensor) -> None:
        if not self.hooks_muted:
            self._on_grad(param)

    def _on_grad(self, param: torch.Tensor) -> None:
        # counted once: autograd runs a parameter's post-accumulate hooks even when a compiled
        # stage's backward graph already handed its gradient over (and returned none for it)
        if not self.armed or id(param) in self._final:
            return
        self._final.add(id(param))
        b = self._bucket[id(param)]
        self._remaining[b] -= 1
        if self._remaining[b] == 0:
            self.launch_times.append(time.perf_counter())
            self.sync.launch(b)

    def disarm(self) -> None:
        self.armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
