"""What the pipeline timeline takes and gives (:func:`lynx.planner.timeline.run_timeline`).

:class:`PipelineCosts` — chunks, per-block costs, p2p times, schedule, the optimizer step and
the runtime's own work per action; :class:`Loads` — recomputation placed in windows or on
demand, and offload copies; the replay's result, :class:`Timeline`, with each device's
:class:`TimedAction` list, the idle :class:`Window` s recomputation can fill and the drawn
:class:`Segment` s. :mod:`lynx.planner.timeline` re-exports them all.

Example::

    >>> from lynx.planner.timeline_types import PipelineCosts
    >>> pipe = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0)
    >>> [len(pipe.device_chunks(d)) for d in range(2)], pipe.boundary_s
    ([1, 1], (0.0,))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from lynx.planner.copy_lanes import CopyLoads, HostCopies
from lynx.planner.partition import BlockCost, Chunk
from lynx.planner.windows import WindowId, as_window_id

if TYPE_CHECKING:
    from lynx.planner.core_sharing import CoreSharing

__all__ = ["PipelineCosts", "Loads", "TimedAction", "Window", "Segment", "Timeline"]


@dataclass(frozen=True)
class PipelineCosts:
    """Everything the timeline needs: chunks, per-block costs, p2p times, schedule."""

    pp: int
    microbatches: int
    schedule: str
    chunks: tuple[Chunk, ...]
    costs: tuple[BlockCost, ...]          # indexed by block
    boundary_s: tuple[float, ...]          # p2p seconds from chunk c to c+1 (and back, same size)
    virtual: int = 1
    optimizer_s: tuple[float, ...] = ()    # per device: its optimizer step, after its last gradient (empty: 0)
    host: Optional[HostCopies] = None      # the host link's copy lanes (offload; lynx.planner.copy_lanes)
    action_s: float = 0.0                  # the runtime's host work per action of a device's list
    # a B on a chunk that sends gradients back posts them after its input-gradient part, before
    # its weight part (the runtime's RuntimeConfig.send_grads_first), where it recomputes nothing
    # on demand (else the runtime runs it whole: StageModule.defer_weights(unless_held=True))
    grads_first: bool = False
    # the host's CPU seconds per byte a device sends or receives, charged to the compute its
    # messages overlap (LinkSpec.host_s_per_byte of the pp link; lynx.planner.link_host), and the
    # bytes of each boundary's message (activation one way, gradient the other)
    link_host_s_per_byte: float = 0.0
    boundary_bytes: tuple[int, ...] = ()
    # the pp link's token bucket (LinkSpec.burst_s): a message sent back to back takes this much longer
    link_burst_s: float = 0.0
    # more ranks than cores: the step re-timed with the cores shared among the busy ranks
    # (lynx.planner.core_sharing); None: a core or device per rank, the costs as they are
    cores: Optional["CoreSharing"] = None

    @staticmethod
    def uniform(*, pp: int, microbatches: int, forward_s: float, backward_s: float,
                schedule: str = "1f1b", p2p_s: float = 0.0, tp_s: float = 0.0, virtual: int = 1) -> "PipelineCosts":
        """``pp × virtual`` chunks of one layer each with the given costs (closed-form checks)."""
        n = pp * virtual
        chunks = tuple(Chunk(index=c, device=c % pp, blocks=(c,), layers=(c,)) for c in range(n))
        costs = tuple(BlockCost(block=c, name=f"layer{c}", layer=c, forward_s=forward_s, backward_s=backward_s,
                                tp_forward_s=tp_s, tp_backward_s=tp_s, param_bytes=0, dp_s=0.0) for c in range(n))
        return PipelineCosts(pp=pp, microbatches=microbatches, schedule=schedule, chunks=chunks, costs=costs,
                        boundary_s=tuple([p2p_s] * max(0, n - 1)), virtual=virtual)

    def device_chunks(self, device: int) -> list[Chunk]:
        return [c for c in self.chunks if c.device == device]


@dataclass(frozen=True)
class Loads:
    """Recomputation to replay: seconds per window id and seconds on demand per
    (chunk, microbatch, block) — the latter run inside that block's backward (a zero-bubble
    ``I``'s), and ``on_demand_weight`` inside its deferred weight part ``W``: the split graphs
    each re-run what they read (:func:`lynx.solvers.memory_weights.regenerated_nodes`)."""

    window: dict[WindowId, float] = field(default_factory=dict)
    on_demand: dict[tuple[int, int, int], float] = field(default_factory=dict)
    on_demand_weight: dict[tuple[int, int, int], float] = field(default_factory=dict)
    copies: Optional[CopyLoads] = None     # offload copies (lynx.planner.copy_lanes)

    def __post_init__(self) -> None:   # a plan's strings become window ids
        if any(not isinstance(k, WindowId) for k in self.window):
            object.__setattr__(self, "window", {as_window_id(k): v for k, v in self.window.items()})


@dataclass
class TimedAction:
    """A scheduled action as the replay ran it."""

    device: int
    kind: str            # "F" | "B" | "I" | "W"
    chunk: int
    microbatch: int
    window: Optional[WindowId] = None   # the window of its wait (the R action before it), if any
    posts: int = 0       # sends and receives the list has the device post after the previous compute action
    load: float = 0.0    # recomputation run in its wait's window, from ``ready``
    ready: float = 0.0   # when the device was free to start it
    arrival: float = 0.0  # when its input (activation or gradient) was available
    start: float = 0.0
    end: float = 0.0


@dataclass(frozen=True)
class Window:
    id: WindowId
    device: int
    kind: str                     # recv_grad | recv_act | tp_allreduce | dp_collective
    microbatch: int               # the backward it serves
    start: float
    capacity_s: float
    eligible_layers: Optional[tuple[int, ...]]
    load_s: float = 0.0           # recomputation placed in it during this replay


@dataclass(frozen=True)
class Segment:
    device: int
    kind: str     # forward | backward | weight | runtime | recompute | tp | wait | dp | send | optimizer
    start: float
    end: float
    label: str = ""


@dataclass
class Timeline:
    pipeline: PipelineCosts
    actions: list[list[TimedAction]]
    windows: list[Window]
    segments: list[Segment]
    step_time_s: float
    device_end_s: list[float]
    busy_s: list[float]            # compute incl. recomputation, per device
    in_flight: list[int]
    exposed_recompute_s: list[float]
    hidden_recompute_s: list[float]
    # offload (lynx.planner.copy_lanes): per device, seconds backwards waited on prefetches; per
    # device and block, the most bytes of other microbatches' device→host copies not yet done
    # when that block's backward starts; bytes copied out and in per step
    exposed_copy_s: list[float] = field(default_factory=list)
    pending_bytes: list[dict[int, int]] = field(default_factory=list)
    copy_bytes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def bubble_s(self) -> list[float]:
        """Per device: step time not spent computing (waits, collectives, pipeline fill)."""
        return [self.step_time_s - b for b in self.busy_s]

    def bubble_fraction(self, device: int = 0) -> float:
        return self.bubble_s[device] / self.step_time_s if self.step_time_s else 0.0

    def window(self, window_id: WindowId | str) -> Window:
        window_id = as_window_id(window_id)
        for w in self.windows:
            if w.id == window_id:
                return w
        raise KeyError(window_id)
