"""Which value of a model's output is the training loss, decided once and applied per microbatch.

The loss is ``loss_fn(output, *targets)`` when a ``loss_fn`` is given; otherwise it is found
in what the model returns, in this order: the output itself when it is a scalar tensor, its
``.loss`` attribute (``transformers``' ``ModelOutput``), or the first scalar tensor of a
tuple or list (nanoGPT's ``(logits, loss)``). :func:`find_loss` decides this from the
output's *structure* — at :func:`lynx.compile` time from the captured graph's output shapes,
so a model without a usable loss is refused before anything runs — and :class:`LossSpec`
applies the decision to every real output on the last pipeline stage.

Example::

    >>> import torch
    >>> spec = find_loss((torch.zeros(2, 8), torch.tensor(1.5)))
    >>> spec.form, spec.index
    ('tuple', 1)
    >>> float(spec(((torch.zeros(2, 8), torch.tensor(2.5)))))
    2.5
    >>> find_loss(torch.zeros(2, 8)).form is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lynx.errors import LynxConfigError, LynxRuntimeError
from lynx.torch_private import out_spec_of, tree_flatten, tree_leaves, tree_unflatten

__all__ = ["LossSpec", "find_loss", "describe_output", "output_structure"]


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def describe_output(value: Any, depth: int = 0) -> str:
    """A short description of an output's structure: types, shapes and dtypes."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if depth < 2 and isinstance(value, Mapping):  # dict, transformers' ModelOutput
        items = ", ".join(f"{k}={describe_output(v, depth + 1)}" for k, v in value.items())
        return f"{type(value).__name__}({items})"
    if depth < 2 and isinstance(value, (tuple, list)):
        inner = ", ".join(describe_output(v, depth + 1) for v in value)
        return f"{type(value).__name__}({inner})"
    return type(value).__name__


@dataclass(frozen=True)
class LossSpec:
    """How the loss is taken from the model's output (see module docstring).

    ``form`` is ``"loss_fn"``, ``"scalar"``, ``"attribute"`` (``.loss``), ``"tuple"`` (element
    ``index``), or ``None`` when the output holds no loss; ``description`` says which, in words.
    """

    form: str | None
    description: str
    index: int | None = None
    loss_fn: Callable[..., Any] | None = None

    def __call__(self, output: Any, targets: Sequence[Any] = ()) -> torch.Tensor:
        """The loss of one microbatch's ``output`` (``targets`` go to ``loss_fn``)."""
        if self.form is None:
            raise LynxConfigError(self.description)
        if self.form == "loss_fn":
            assert self.loss_fn is not None
            loss = self.loss_fn(output, *targets)
        elif self.form == "scalar":
            loss = output
        elif self.form == "attribute":
            loss = output.loss
        else:
            loss = output[self.index]
        if not _is_scalar(loss):
            raise LynxRuntimeError(
                f"the loss must be a floating-point scalar tensor ({self.description}), got {describe_output(loss)}")
        return loss.reshape(())

    def with_loss_fn(self, loss_fn: Callable[..., Any] | None) -> "LossSpec":
        """This spec, or one calling ``loss_fn(output, *targets)`` when it is given."""
        if loss_fn is None:
            return self
        if not callable(loss_fn):
            raise LynxConfigError(
                f"loss_fn must be callable as loss_fn(output, *targets), got {type(loss_fn).__name__}")
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        return LossSpec("loss_fn", f"the loss is loss_fn(output, *targets) with loss_fn={name}", loss_fn=loss_fn)


def find_loss(output: Any, loss_fn: Callable[..., Any] | None = None) -> LossSpec:
    """Decide which form of ``output`` is the loss (``loss_fn`` first; see module docstring)."""
    shown = describe_output(output)
    if loss_fn is not None:
        return LossSpec(None, "").with_loss_fn(loss_fn)
    if _is_scalar(output):
        return LossSpec("scalar", f"the model returns a scalar ({shown}): it is the loss")
    loss = getattr(output, "loss", None) if not isinstance(output, torch.Tensor) else None
    if _is_scalar(loss):
        return LossSpec("attribute", f"the model returns {shown}: the loss is its .loss")
    if isinstance(output, (tuple, list)):
        for i, value in enumerate(output):
            if _is_scalar(value):
                return LossSpec("tuple", f"the model returns {shown}: the loss is element {i}, its first scalar",
                                index=i)
    return LossSpec(None, (
        f"the model returns {shown}, which holds no loss: not a scalar tensor, no .loss scalar, no scalar in a "
        "tuple. Return the loss from forward (e.g. (logits, loss)), or pass loss_fn=fn with "
        "fn(output, *targets) -> scalar to lynx.compile or lynx.runtime.Pipeline"))


def output_structure(gm: Any) -> Any:
    """The captured graph's output with each tensor replaced by its recorded value (a fake or
    meta tensor of the right shape), in the model's structure; None when shapes were not recorded
    (a ``symbolic_trace`` capture)."""
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    leaves, spec = tree_flatten(output.args[0])
    values = []
    for leaf in leaves:
        val = getattr(leaf, "meta", {}).get("val") if hasattr(leaf, "meta") else leaf
        if hasattr(leaf, "meta") and val is None:
            return None
        values.append(val)
    structure = tree_unflatten(values, spec)
    out_spec = out_spec_of(gm)
    if out_spec is not None:
        structure = tree_unflatten(tree_leaves(structure), out_spec)
    return structure
