"""What the generated stage graphs call: RNG save and replay, a recompute clock, a gradient sink.

:mod:`lynx.rewrite.emit` writes calls to these functions into the forward, recompute and
backward graphs as ``call_function`` nodes, and hands the graphs a :class:`Clock` and a
:class:`GradSink` as attributes (``lynx_clock``, ``lynx_sink``):

* :func:`save_rng_state` in the forward, before each random op the plan drops, and
  :func:`replay_rng` where that op is recomputed: dropout draws the same mask bitwise;
* :func:`clock_start` / :func:`clock_stop` around the recomputation a backward graph runs on
  demand (what the runtime reports as exposed recompute);
* :func:`accumulate_grad` in a backward graph, for each parameter gradient as soon as it is
  final, so that a data-parallel bucket can launch before the backward ends.

Example::

    >>> import torch
    >>> state = save_rng_state(torch.device("cpu"))
    >>> a = replay_rng(state, torch.device("cpu"), torch.rand, 3)
    >>> b = replay_rng(state, torch.device("cpu"), torch.rand, 3)
    >>> torch.equal(a, b)
    True
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["save_rng_state", "replay_rng", "Clock", "clock_start", "clock_stop", "GradSink", "accumulate_grad"]


def save_rng_state(device: torch.device) -> torch.Tensor:
    """The generator state a random op on ``device`` is about to draw from (a graph node)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def replay_rng(state: torch.Tensor, device: torch.device, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run random ``op`` from generator ``state`` and leave the generator as it was (a graph node)."""
    if device.type == "cuda":
        current = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
        try:
            return op(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(current, device)
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_rng_state(current)


class Clock(torch.nn.Module):
    """Seconds spent between :func:`clock_start` and :func:`clock_stop` calls of one graph.

    A module only so that ``fx.GraphModule`` carries it as an attribute the graph reads.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total_s = 0.0
        self.since = 0.0


def clock_start(clock: Clock) -> None:
    clock.since = time.perf_counter()


def clock_stop(clock: Clock) -> None:
    clock.total_s += time.perf_counter() - clock.since


class GradSink(torch.nn.Module):
    """Where a backward graph puts parameter gradients as they become final (see :func:`accumulate_grad`)."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[torch.Tensor] = []
        # called with the parameter once its .grad holds this gradient
        self.on_grad: Callable[[torch.Tensor], None] | None = None


def accumulate_grad(sink: GradSink, index: int, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does for parameter ``index``, then tell ``sink.on_grad``."""
    param = sink.params[index]
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    if sink.on_grad is not None:
        sink.on_grad(param)
