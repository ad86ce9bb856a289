"""A stage's copy lanes as the solvers see them: bandwidth, prefetch slots, host budget, pending copies.

With ``offload=True`` every :class:`~lynx.solvers.problem.StageProblem` carries a
:class:`StageCopies` (built by :func:`lynx.planner.problems.build_problems` from the timeline and
the hardware's host link). An offloaded node's saved bytes are copied device → host when its
block's forward ends and host → device before its backward reads them, on copy lanes of their
own (one per direction), so offload costs bandwidth and host memory, not compute:

* **prefetch** (H2D): streamed during the backward, each value issued when the backward reaches
  the group (layer or edge block) *before* the group that first reads it — one group of
  backward time to arrive — or, for what the stage's first-backpropagated group reads, in the
  earliest window serving the microbatch (:class:`PrefetchSlot`: the ``R`` position and the
  seconds from it to the backward's start). A prefetch holds device memory from its issue to
  its last reader, like a value recomputed in a window.
* **offload** (D2H): a value stays on the device until its copy completes. The lane drains at
  its bandwidth while forwards keep producing, so at a backward's start some of what earlier
  forwards offloaded may still be on the device (``pending``): bounded here, for per-group
  offloaded bytes ``D_g``, by ``max_t (Σ_g c_tg·D_g − drained_t)`` over the terms the
  timeline gives (forwards whose copies can still be queued, the bytes the lane moved since),
  plus one copy in service where that is positive (where it is not, the lane is idle: nothing
  is pending). It drains further as the backward runs (``group_backward_s``).
* **synchronous** links (a CPU device) copy on the compute thread: nothing is pending, and
  each copy's seconds are compute.

Example::

    >>> c = StageCopies(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, alpha_s=0.0, synchronous=False,
    ...                 host_budget_bytes=2**40, slots=(), group_backward_s=(0.002, 0.002),
    ...                 pending=(((1, 1), 1e6),))   # one forward of both groups, 1 MB moved since
    >>> c.pending_bytes([3_000_000, 1_000_000])      # 4 MB offloaded - 1 MB moved + 3 MB in service
    6000000
    >>> c.pending_during(6_000_000, group=0, groups=2)   # after the top group's 2 ms of backward
    4000000
    >>> import dataclasses
    >>> c = dataclasses.replace(c, group_forward_s=(0.001, 0.001))   # 1 ms forwards, 1 MB per ms
    >>> c.drains_by_backward([500_000, 0]), c.drains_by_backward([0, 500_000])   # out by 1.5 ms / 2.5 ms
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lynx.planner.windows import WindowId

__all__ = ["PrefetchSlot", "StageCopies"]


@dataclass(frozen=True)
class PrefetchSlot:
    """Where a microbatch's first prefetch is issued: the earliest ``R`` position serving its
    backward, and the seconds from there to the backward's start (what the copy can take)."""

    window: WindowId
    slack_s: float


@dataclass(frozen=True)
class StageCopies:
    """One stage's copy lanes and host budget (see the module docstring)."""

    d2h_bytes_per_s: float   # per device: a shared link's share
    h2d_bytes_per_s: float
    alpha_s: float           # per copy
    synchronous: bool        # copies on the compute thread (CPU)
    host_budget_bytes: int   # pinned host memory this device may fill
    slots: tuple[PrefetchSlot | None, ...]      # per microbatch (None: no R position serves it)
    group_backward_s: tuple[float, ...]         # per group rank (forward order): its backward's seconds
    # (forwards per group rank whose offload copies may still be queued, bytes the D2H lane moved since)
    pending: tuple[tuple[tuple[int, ...], float], ...] = ()
    group_forward_s: tuple[float, ...] = ()     # per group rank: its forward's seconds (() : unknown)

    def drains_by_backward(self, offloaded_by_group: Sequence[int]) -> bool:
        """Whether a microbatch's copies to the host, ``offloaded_by_group[g]`` bytes issued as
        group ``g``'s forward ends, all end by the end of its forward: on a stage holding one
        microbatch (its backward follows its forward) what is still being copied out is still
        on the device when the backward starts, which the memory model does not count. One
        lane, first come first served; unknown forward times: only if nothing is copied."""
        if self.synchronous or not any(offloaded_by_group):
            return True
        if len(self.group_forward_s) < len(offloaded_by_group):
            return False
        t = lane = 0.0
        for f, nbytes in zip(self.group_forward_s, offloaded_by_group):
            t += f
            if nbytes > 0:
                lane = max(lane, t) + self.d2h_s(nbytes)
        return lane <= t + 1e-12

    def pending_bytes(self, offloaded_by_group: Sequence[int]) -> int:
        """Bytes still on the device, waiting for their D2H copy, at the worst backward's start."""
        if self.synchronous or not self.pending or not any(offloaded_by_group):
            return 0
        worst = max(sum(c * d for c, d in zip(counts, offloaded_by_group)) - drained
                    for counts, drained in self.pending)
        if worst <= 0:   # every term drained: the lane is idle, so no copy is in service either
            return 0
        return int(worst) + max(offloaded_by_group)

    def pending_during(self, pending: int, group: int, groups: int) -> int:
        """``pending`` bytes left when the backward reaches group rank ``group`` of ``groups``
        (the groups above it backpropagated meanwhile, the lane still draining)."""
        if pending <= 0:
            return 0
        above = sum(self.group_backward_s[g] for g in range(group + 1, groups) if g < len(self.group_backward_s))
        return int(max(0.0, pending - self.d2h_bytes_per_s * above))

    def d2h_s(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.d2h_bytes_per_s if nbytes > 0 else 0.0

    def h2d_s(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.h2d_bytes_per_s if nbytes > 0 else 0.0
