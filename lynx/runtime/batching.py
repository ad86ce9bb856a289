"""A step's whole batch, as the model takes it, cut into this replica's microbatches.

:meth:`lynx.runtime.Pipeline.step` takes the inputs of one training step for the whole job —
``dp × microbatches`` microbatches of the size the model was compiled for, stacked along dim 0,
positional or by keyword, as the model's ``forward`` takes them. :func:`bind_inputs` names
them as the captured graph does; :func:`split_rows` gives data-parallel replica ``d`` rows
``[d·m·b, (d+1)·m·b)`` cut into its ``m`` microbatches of ``b`` rows; :func:`match_layout`
copies a microbatch into the memory layout of the example input the graph was captured with
(``torch.export`` bakes the example's layout into views such as ``targets.view(-1)``: a
non-contiguous slice would fail there).

Example::

    >>> import torch
    >>> x = torch.arange(16).reshape(8, 2)[:, :1]                 # (8, 1), not contiguous
    >>> parts = split_rows(x, "x", dp=2, dp_rank=1, microbatches=2)
    >>> [p.flatten().tolist() for p in parts]
    [[8, 10], [12, 14]]
    >>> match_layout(parts[0], torch.zeros(2, 1)).is_contiguous()
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lynx.errors import LynxConfigError

__all__ = ["bind_inputs", "split_rows", "match_layout", "check_microbatch", "check_batch", "index_limits",
           "check_indices", "IndexLimit"]


def bind_inputs(names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` and ``kwargs`` named as the captured graph's inputs ``names`` (forward's order)."""
    if len(args) > len(names):
        raise LynxConfigError(f"step() got {len(args)} positional inputs but the model was compiled with "
                              f"{len(names)} ({', '.join(names)})")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise LynxConfigError(f"step() got an input {key!r} the compiled model does not take; its inputs are "
                                  f"{', '.join(names)} (the example inputs given to lynx.compile)")
        if key in bound:
            raise LynxConfigError(f"step() got input {key!r} both by position and by keyword")
        bound[key] = value
    return bound


def check_batch(value: Any, name: str, example: torch.Tensor, *, dp: int, microbatches: int) -> None:
    """Refuse a step's batch whose dimensions other than the first are not the example's."""
    if not isinstance(value, torch.Tensor) or not example.dim():
        return
    if value.dim() != example.dim() or tuple(value.shape[1:]) != tuple(example.shape[1:]):
        want = (example.shape[0] * dp * microbatches, *example.shape[1:])
        raise LynxConfigError(
            f"step() input {name!r} is {tuple(value.shape)} ({value.dim()} dimensions) but the model was compiled "
            f"for {tuple(example.shape)} per microbatch: a step takes {want} (dp {dp} × {microbatches} "
            f"microbatches × {example.shape[0]} rows along dim 0, the other dimensions as compiled)")


@dataclass(frozen=True)
class IndexLimit:
    """The values an integer model input may hold: ``0 <= v < high``, or ``v == ignore``."""

    high: int
    ignore: int | None
    what: str          # the op and weight it indexes, for the message


# ops that pass an input's values through unchanged (only its shape or layout)
_SAME_VALUES = ("view", "reshape", "_unsafe_view", "flatten", "contiguous", "clone", "alias", "squeeze",
                "unsqueeze", "expand", "to", "_to_copy", "slice", "select", "permute", "transpose", "t")


def index_limits(gm: Any) -> dict[str, IndexLimit]:
    """Per model input of ``gm`` (a captured graph) that an embedding or a cross-entropy indexes
    directly (through views), the range its values must lie in."""
    limits: dict[str, IndexLimit] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        stack, seen = [node], set()
        while stack:
            current = stack.pop()
            for user in current.users:
                if user in seen:
                    continue
                seen.add(user)
                op = _op_name(user.target)
                limit = _limit_of(user, op, current)
                if limit is not None:
                    limits.setdefault(node.name, limit)
                elif op in _SAME_VALUES and user.args and user.args[0] is current:
                    stack.append(user)
    return limits


def _op_name(target: Any) -> str:
    """``embedding`` for ``aten.embedding.default``; a Python function's own name otherwise."""
    text = str(target)
    return text.split(".")[1] if text.startswith("aten.") else getattr(target, "__name__", text)


def _limit_of(user: Any, op: str, value: Any) -> IndexLimit | None:
    def shape(node: Any) -> tuple[int, ...] | None:
        val = node.meta.get("val") if hasattr(node, "meta") else None
        return tuple(val.shape) if isinstance(val, torch.Tensor) else None

    if op == "embedding" and len(user.args) > 1 and user.args[1] is value:
        weight = shape(user.args[0])
        if weight:
            owner = user.args[0].target if user.args[0].op == "get_attr" else user.args[0].name
            return IndexLimit(weight[0], None, f"the vocabulary 0..{weight[0] - 1} of embedding {owner}")
    if op in ("cross_entropy_loss", "nll_loss", "nll_loss_nd") and len(user.args) > 1 and user.args[1] is value:
        logits = shape(user.args[0])
        if logits:
            classes = logits[1] if len(logits) > 1 else logits[0]
            ignore = user.args[4] if len(user.args) > 4 else user.kwargs.get("ignore_index", -100)
            return IndexLimit(classes, int(ignore), f"the classes 0..{classes - 1} of {op} (ignore_index {ignore})")
    return None


def check_indices(value: torch.Tensor, name: str, limit: IndexLimit) -> None:
    """Refuse ``value`` when it holds an index outside ``limit`` (checked on the CPU only: a
    tensor already on a GPU would cost a device synchronisation per step)."""
    if value.device.type != "cpu" or value.is_floating_point() or value.numel() == 0:
        return
    bad = (value < 0) | (value >= limit.high)
    if limit.ignore is not None:
        bad &= value != limit.ignore
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise LynxConfigError(
            f"step() input {name!r} holds {int(value[where])} at {list(where)}, outside {limit.what}: check the "
            f"data's token ids against the model's vocabulary size")


def split_rows(value: Any, name: str, *, dp: int, dp_rank: int, microbatches: int) -> list[torch.Tensor]:
    """Replica ``dp_rank``'s ``microbatches`` microbatches of the job's batch ``value`` (dim 0)."""
    if not isinstance(value, torch.Tensor):
        raise LynxConfigError(f"step() input {name!r} must be a tensor, got {type(value).__name__}")
    parts = dp * microbatches
    if value.dim() == 0 or value.shape[0] % parts:
        rows = value.shape[0] if value.dim() else 0
        raise LynxConfigError(
            f"step() input {name!r} has {rows} rows along dim 0, not a multiple of dp × microbatches = "
            f"{dp} × {microbatches} = {parts}: pass the whole step's batch (every replica's microbatches)")
    per = value.shape[0] // parts
    mine = value[dp_rank * microbatches * per:(dp_rank + 1) * microbatches * per]
    return list(mine.split(per))


def check_microbatch(value: torch.Tensor, name: str, example: torch.Tensor, *, dp: int, microbatches: int) -> None:
    """Refuse a microbatch of another shape or dtype than the example input it replaces."""
    if tuple(value.shape) != tuple(example.shape) or value.dtype != example.dtype:
        rows = example.shape[0] * dp * microbatches if example.dim() else "?"
        raise LynxConfigError(
            f"step() input {name!r}: a microbatch is {tuple(value.shape)} {value.dtype} but the model was compiled "
            f"for {tuple(example.shape)} {example.dtype} (its example input); a step takes {rows} rows "
            f"(dp {dp} × {microbatches} microbatches × {example.shape[0] if example.dim() else '?'}), "
            "the other dimensions as compiled")


def match_layout(value: torch.Tensor, example: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``value`` on ``device`` in ``example``'s memory layout (strides), copying only when needed."""
    device = device or value.device
    if example.is_contiguous():
        return value.to(device).contiguous()
    if value.stride() == example.stride() and value.device == device:
        return value
    if _dense(example):
        out = torch.empty_strided(example.shape, example.stride(), dtype=value.dtype, device=device)
        return out.copy_(value)
    return value.to(device).contiguous()


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps (any dim order)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
