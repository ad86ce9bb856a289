"""One forward and one backward of one stage for one microbatch — shared by every executor.

The values a stage receives become leaves (``requires_grad`` where the sender's value needed
a gradient), so after the stage's backward their ``.grad`` is exactly what goes back to the
previous stage. The last stage's output is the model's loss (a scalar); its backward starts
there.

Example::

    >>> import torch
    >>> received = as_received([torch.ones(2, requires_grad=True)])
    >>> received[0].is_leaf, received[0].requires_grad
    (True, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lynx.errors import LynxRuntimeError

__all__ = ["InFlight", "as_received", "forward_step", "backward_step", "needs_grad"]


def needs_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None)


def as_received(values: Sequence[torch.Tensor], requires_grad: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Fresh leaves holding ``values`` (no history), requiring grad as the sender's did."""
    flags = requires_grad if requires_grad is not None else [needs_grad(v) for v in values]
    return [v.detach().requires_grad_(bool(f) and v.is_floating_point()) for v, f in zip(values, flags)]


@dataclass
class InFlight:
    """A microbatch between its forward and its backward on one stage."""

    received: list[torch.Tensor]
    output: Any


def forward_step(stage: Any, microbatch: int, inputs: Mapping[str, torch.Tensor],
                 received: Sequence[torch.Tensor]) -> InFlight:
    """Run ``stage`` forward on ``microbatch``: model ``inputs`` by name, ``received`` leaves."""
    try:
        args = [inputs[name] for name in stage.spec.inputs]
    except KeyError as err:
        raise LynxRuntimeError(f"stage {stage.index} needs model input {err.args[0]!r}; "
                               f"the microbatch has {sorted(inputs)}") from None
    with torch.enable_grad():
        output = stage(*args, *received, microbatch=microbatch)
    if stage.spec.is_last and not (isinstance(output, torch.Tensor) and output.numel() == 1):
        raise LynxRuntimeError(
            f"the last stage must return the loss (a scalar tensor); the model returns {type(output).__name__}"
            + (f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else "")
            + ". Wrap the model so forward(inputs, targets) returns the loss.")
    return InFlight(list(received), output)


def backward_step(stage: Any, microbatch: int, flight: InFlight,
                  grads: Sequence[torch.Tensor | None] | None, loss_scale: float = 1.0) -> list[torch.Tensor | None]:
    """Backward of ``stage`` on ``microbatch`` given the gradients of its sent values.

    Returns the gradients of what it received (``None`` where none is needed).
    """
    if stage.spec.is_last:
        loss = flight.output
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
    else:
        pairs = [(o, g) for o, g in zip(flight.output, grads or ()) if g is not None and needs_grad(o)]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [r.grad if r.requires_grad else None for r in flight.received]
