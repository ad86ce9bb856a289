"""What the timeline's replay reads off the action lists and the chunk layout before it runs.

Per device: its compute actions as :class:`~lynx.planner.timeline_types.TimedAction` s, each
with the window its ``R`` action names and the sends and receives posted since the compute
action before it (:func:`timed_actions`); the posts after its last compute action
(:func:`trailing_posts`); the most microbatches it holds in flight (:func:`in_flight`); the
layers a window's recomputation may serve (:func:`eligible_layers`). The replay itself:
:mod:`lynx.planner.timeline`.
"""

from __future__ import annotations

from typing import Optional

from lynx.planner.schedule import POSTS, Op
from lynx.planner.timeline_types import PipelineCosts, TimedAction

__all__ = ["timed_actions", "trailing_posts", "in_flight", "eligible_layers", "chunk_of_block"]


def chunk_of_block(pipe: PipelineCosts, block: int) -> int:
    return next(c.index for c in pipe.chunks if block in c.blocks)


def timed_actions(device: int, actions: list) -> list[TimedAction]:
    """The compute actions of a device's list, each with the window its ``R`` action names and
    the sends and receives posted since the compute action before it."""
    out, window, posts = [], None, 0
    for a in actions:
        if a.op is Op.RECOMPUTE:
            window = a.window
        elif a.op in POSTS:
            posts += 1
        elif a.is_compute:
            out.append(TimedAction(device=device, kind=a.kind, chunk=a.chunk, microbatch=a.microbatch, window=window,
                                   posts=posts))
            window, posts = None, 0
    return out


def trailing_posts(actions: list) -> int:
    """Sends and receives a device's list posts after its last compute action."""
    last = max((i for i, a in enumerate(actions) if a.is_compute), default=-1)
    return sum(1 for a in actions[last + 1:] if a.op in POSTS)


def in_flight(actions: list[list[TimedAction]], virtual: int) -> list[int]:
    """Per device: most microbatches forwarded but not yet backpropagated, at a backward's start
    (chunk-microbatch pairs ÷ chunks per device, rounded up, for the interleaved schedule); under
    zero bubble a microbatch is in flight until its ``W``."""
    result = []
    for acts in actions:
        split = any(a.kind == "W" for a in acts)
        live, peak = 0, 0
        for a in acts:
            if a.kind == "F":
                live += 1
            elif a.kind == "I":
                peak = max(peak, live)
            elif a.kind == "W" or (a.kind == "B" and not split):
                peak = max(peak, live)
                live -= 1
        result.append(-(-peak // virtual))
    return result


def eligible_layers(pipe: PipelineCosts, s: int, upto_chunk: int, below_block: Optional[int]) -> tuple[int, ...]:
    """Layers of device s not yet backpropagated: chunks up to ``upto_chunk``, and within it
    the blocks before ``below_block``."""
    layers: list[int] = []
    for c in pipe.device_chunks(s):
        if c.index > upto_chunk:
            continue
        for b in c.blocks:
            if c.index == upto_chunk and below_block is not None and b >= below_block:
                continue
            layer = pipe.costs[b].layer
            if layer is not None:
                layers.append(layer)
    return tuple(sorted(layers))
