"""Copy lanes: the host link's copy engines as resources of their own in the pipeline timeline.

Offloading (``offload=True``) copies saved values device → host after their forward and host →
device before their backward. Those copies run on copy engines beside compute, one **lane per
direction**; devices that share a host link (``HostLinkSpec.shared_by``; the tensor- and
data-parallel peers of a stage copy the same bytes at the same time and so each get a share of
it) share its lanes. :class:`HostCopies` is what the timeline knows of the link;
:class:`CopyLoads` what a plan puts on the lanes; :class:`CopyReplay` does the bookkeeping the
replay (:mod:`lynx.planner.timeline`) asks for:

* after each block's forward, its offloaded bytes go on the D2H lane (:meth:`CopyReplay.offload`);
  they stay on the device until that copy ends;
* at a window (an ``R`` position) the prefetches the plan names there go on the H2D lane, and
  the backward they serve waits for them; inside a backward, a block's streamed prefetches are
  issued when the block before it (in backward order) starts, and waited on before the block
  that reads them (:meth:`CopyReplay.issue`, :meth:`CopyReplay.arrival`). A prefetch starts
  once the copy-outs of the blocks whose values it brings back have ended
  (``CopyLoads.sources``), not every copy-out of its microbatch: the runtime's copy streams, one
  per direction, wait on each value's own D2H event (:mod:`lynx.rewrite.offload`) — on a stage
  whose backward follows its forward, the last blocks' copy-outs still run when the first
  prefetches start;
* :meth:`CopyReplay.pending` — bytes whose D2H copy has not ended at a given time, the
  backpropagated microbatch's own included (its storage is released only once its copy is
  done): device memory offloading has not freed yet (the simulator adds it to the peak).

A device's copies in one direction run in the order it issues them (the runtime's copy stream
per direction is in order: a prefetch waiting on a copy-out's event holds up the prefetches
queued behind it), and a device's copy-outs issued after a microbatch's backward ended wait for
the prefetches it issued until then (``HostStore`` hands the host buffers back:
:meth:`CopyReplay.release`). A lane books each copy into the first gap at or after that time
long enough to hold it (devices are replayed one after another, so a lane shared by several
devices is not asked in time order). On a synchronous link (a CPU) nothing runs beside compute:
a copy's seconds are the device's own.

Example::

    >>> from lynx.planner.host_link import HostLinkSpec
    >>> lane = Lane()
    >>> lane.book(0.0, 2.0, tag=(0, 0), produced=0.0), lane.book(1.0, 1.0, tag=(0, 1), produced=1.0)
    ((0.0, 2.0), (2.0, 3.0))
    >>> lane.book(0.0, 0.5, tag=(1, 0), produced=-1.0)   # no gap before 3.0 holds it
    (3.0, 3.5)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Optional

from lynx.planner.host_link import HostLinkSpec
from lynx.planner.windows import WindowId

__all__ = ["HostCopies", "CopyLoads", "Lane", "CopyReplay"]


@dataclass(frozen=True)
class HostCopies:
    """The host link as the timeline uses it: per pipeline device, its lanes and its bandwidth."""

    link: HostLinkSpec
    lane_of_device: tuple[int, ...]   # devices with the same index share both lanes
    share: int                        # the stage's tp·dp peers copying at once, up to shared_by

    @staticmethod
    def from_hardware(hardware: Any, *, pp: int, tp: int = 1, dp: int = 1) -> "HostCopies":
        """Ranks are numbered tp fastest, then dp, then pp (Megatron's order): ``shared_by``
        consecutive ranks share a link — the stage's own peers first, then neighbouring stages."""
        from lynx.planner.host_link import host_link_of

        link = host_link_of(hardware)
        peers = max(1, tp * dp)
        share = min(link.shared_by, peers)
        stages_per_link = max(1, link.shared_by // peers)
        return HostCopies(link=link, lane_of_device=tuple(s // stages_per_link for s in range(pp)), share=share)

    def seconds(self, nbytes: int, direction: str) -> float:
        """One copy of ``nbytes`` by one device while its peers copy theirs."""
        if nbytes <= 0:
            return 0.0
        rate = self.link.d2h_bytes_per_s if direction == "d2h" else self.link.h2d_bytes_per_s
        return self.link.alpha_s + nbytes * self.share / rate

    def rate(self, direction: str) -> float:
        """Bytes/s one device gets while its peers copy too."""
        rate = self.link.d2h_bytes_per_s if direction == "d2h" else self.link.h2d_bytes_per_s
        return rate / self.share


@dataclass(frozen=True)
class CopyLoads:
    """What a plan puts on the copy lanes (keys: ``(chunk, microbatch)``, blocks by index).

    ``offload``: bytes each block's forward copies to the host; ``window``: per window id, the
    ``(chunk, microbatch, bytes)`` prefetched there (waited on when that backward starts);
    ``streamed``: per backward, ``(issue block or None, reading block, bytes)`` — issued when
    the issue block's backward starts (None: when the backward starts), waited on before the
    reading block's. ``sources``: per ``(chunk, microbatch, reading block)`` (None: the window
    prefetches), the blocks whose forwards copied out what it brings back (absent: every block
    of the microbatch, the conservative rule). ``window_reads``: per tensor-parallel window,
    the reading blocks whose streamed prefetches its recomputation reads — the runtime waits
    for a prefetch before its first reader only (:func:`lynx.rewrite.offload.offload_wait`), so
    a window that reads none of them waits for none (absent: it reads none)."""

    offload: dict[tuple[int, int, int], int] = field(default_factory=dict)
    window: dict[WindowId, list[tuple[int, int, int]]] = field(default_factory=dict)
    streamed: dict[tuple[int, int], list[tuple[Optional[int], int, int]]] = field(default_factory=dict)
    sources: dict[tuple[int, int, Optional[int]], frozenset[int]] = field(default_factory=dict)
    window_reads: dict[WindowId, frozenset[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.offload)


class Lane:
    """One copy engine: booked intervals, first fit (see the module docstring)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.items: list[tuple[float, float, Any, float, int]] = []   # (start, end, tag, produced, bytes)

    def book(self, ready: float, seconds: float, *, tag: Any, produced: float, nbytes: int = 0) -> tuple[float, float]:
        """Reserve ``seconds`` at the first gap at or after ``ready``; ``(start, end)``."""
        i = bisect.bisect_right(self.ends, ready)
        start = ready
        while i < len(self.items):
            if start + seconds <= self.starts[i] + 1e-15:
                break
            start = max(start, self.ends[i])
            i += 1
        self.starts.insert(i, start)
        self.ends.insert(i, start + seconds)
        self.items.insert(i, (start, start + seconds, tag, produced, nbytes))
        return start, start + seconds

    def held(self, t: float, exclude: Any = None, tag_filter: Any = None) -> int:
        """Bytes of copies produced by ``t`` and not finished at ``t`` (other tags than ``exclude``)."""
        total = 0
        for start, end, tag, produced, nbytes in self.items[bisect.bisect_right(self.ends, t):]:
            if produced <= t and tag != exclude and (tag_filter is None or tag_filter(tag)):
                total += nbytes
        return total


class CopyReplay:
    """The lanes of one replay and what waits on them (see the module docstring)."""

    def __init__(self, host: HostCopies, loads: CopyLoads) -> None:
        self.host, self.loads = host, loads
        lanes = max(host.lane_of_device) + 1 if host.lane_of_device else 1
        self.d2h = [Lane() for _ in range(lanes)]
        self.h2d = [Lane() for _ in range(lanes)]
        self.offloaded_at: dict[tuple[int, int], float] = {}    # (chunk, mb) -> its last D2H copy's end
        self.block_out_at: dict[tuple[int, int, int], float] = {}   # (chunk, mb, block) -> its D2H copy's end
        self.ready_at: dict[tuple[int, int, Optional[int]], float] = {}   # (chunk, mb, reading block) -> arrival
        self.bytes_out: dict[int, int] = {}   # per device: bytes copied to the host per step
        self.bytes_in: dict[int, int] = {}
        # per device: when its last copy in each direction ends (each direction is one stream,
        # in issue order), and the prefetches its copy-outs wait for (release)
        self.d2h_tail: dict[int, float] = {}
        self.h2d_tail: dict[int, float] = {}
        self.d2h_floor: dict[int, float] = {}

    @property
    def synchronous(self) -> bool:
        return self.host.link.synchronous

    def offload(self, device: int, chunk: int, mb: int, block: int, t: float) -> tuple[float, float, float]:
        """Block ``block``'s forward of ``(chunk, mb)`` ended at ``t``: book its D2H copy.
        ``(start, end, compute seconds)`` — the last non-zero only on a synchronous link."""
        nbytes = self.loads.offload.get((chunk, mb, block), 0)
        if nbytes <= 0:
            return t, t, 0.0
        seconds = self.host.seconds(nbytes, "d2h")
        self.bytes_out[device] = self.bytes_out.get(device, 0) + nbytes
        if self.synchronous:
            self.offloaded_at[(chunk, mb)] = self.block_out_at[(chunk, mb, block)] = t + seconds
            return t, t + seconds, seconds
        ready = max(t, self.d2h_tail.get(device, 0.0), self.d2h_floor.get(device, 0.0))
        start, end = self.d2h[self.host.lane_of_device[device]].book(ready, seconds, tag=(device, chunk, mb),
                                                                      produced=t, nbytes=nbytes)
        self.d2h_tail[device] = end
        self.offloaded_at[(chunk, mb)] = max(self.offloaded_at.get((chunk, mb), 0.0), end)
        self.block_out_at[(chunk, mb, block)] = end
        return start, end, 0.0

    def out_at(self, chunk: int, mb: int, reader: Optional[int]) -> float:
        """When what a prefetch for block ``reader`` of ``(chunk, mb)`` brings back (None: the
        window prefetches) is all on the host: its source blocks' copy-outs ended."""
        blocks = self.loads.sources.get((chunk, mb, reader))
        if blocks is None:   # (not said: every copy-out of the microbatch)
            return self.offloaded_at.get((chunk, mb), 0.0)
        return max((self.block_out_at.get((chunk, mb, b), 0.0) for b in blocks), default=0.0)

    def issue(self, device: int, chunk: int, mb: int, nbytes: int, t: float, reader: Optional[int]
              ) -> tuple[float, float, float]:
        """A prefetch of ``nbytes`` for ``(chunk, mb)``'s block ``reader`` (None: the whole
        backward) issued at ``t``. ``(start, end, compute seconds)`` as :meth:`offload`."""
        if nbytes <= 0:
            return t, t, 0.0
        seconds = self.host.seconds(nbytes, "h2d")
        self.bytes_in[device] = self.bytes_in.get(device, 0) + nbytes
        key = (chunk, mb, reader)
        if self.synchronous:
            self.ready_at[key] = max(self.ready_at.get(key, 0.0), t + seconds)
            return t, t + seconds, seconds
        # back only once it is out, and after what the device's h2d stream has queued before it
        ready = max(t, self.out_at(chunk, mb, reader), self.h2d_tail.get(device, 0.0))
        start, end = self.h2d[self.host.lane_of_device[device]].book(ready, seconds, tag=(device, chunk, mb),
                                                                      produced=ready, nbytes=nbytes)
        self.h2d_tail[device] = end
        self.ready_at[key] = max(self.ready_at.get(key, 0.0), end)
        return start, end, 0.0

    def arrival(self, chunk: int, mb: int, reader: Optional[int]) -> float:
        """When what block ``reader`` of ``(chunk, mb)`` reads is back (0: nothing to wait for)."""
        return self.ready_at.get((chunk, mb, reader), 0.0)

    def release(self, device: int) -> None:
        """A microbatch's backward ended on ``device``: its host buffers go back to the pool, so
        the device's later copy-outs wait for the prefetches it issued until now."""
        if not self.synchronous and device in self.h2d_tail:
            self.d2h_floor[device] = max(self.d2h_floor.get(device, 0.0), self.h2d_tail[device])

    def pending(self, device: int, t: float) -> int:
        """Bytes this device's forwards offloaded by ``t`` whose D2H copy has not ended at ``t``
        (every microbatch's: the one backpropagated too)."""
        if self.synchronous:
            return 0
        lane = self.d2h[self.host.lane_of_device[device]]
        return lane.held(t, tag_filter=lambda tag: tag[0] == device)
