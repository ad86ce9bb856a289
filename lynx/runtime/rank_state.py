"""What a bitwise-exact resume of one rank needs, in the form :mod:`lynx.runtime.checkpoint` writes.

:class:`RankState` gathers a rank's stage tensors (parameters and buffers by name, live), its
optimizer, the next step and, on save, the RNG states (CPU, and CUDA when present);
:func:`lynx.runtime.checkpoint.save_checkpoint` / ``load_checkpoint`` take it. A training
script over :class:`lynx.runtime.Pipeline` builds one from its pipe and optimizer with
:func:`pipeline_state` (``examples/train_gpt.py``).

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> state = RankState(dict(lin.named_parameters()), torch.optim.SGD(lin.parameters(), lr=0.1), topo=None)
    >>> saved = state.state_dict()
    >>> sorted(saved), saved["step"]
    (['model', 'optimizer', 'rng', 'step'], 0)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["RankState", "pipeline_state", "stage_tensors"]


def stage_tensors(stage: Any, names: set[str]) -> dict[str, torch.Tensor]:
    """The parameters and buffers the stage graph reads (``get_attr`` targets), by name."""
    out = {}
    for name in sorted(names):
        value = functools.reduce(getattr, name.split("."), stage.gm)
        if isinstance(value, torch.Tensor):
            out[name] = value
    return out


class RankState:
    """A rank's resumable state (see module docstring); ``topo`` places it on the mesh; ``rng``
    is the rank's :class:`~lynx.runtime.rank_rng.RankRNG` (None: the process's global one)."""

    def __init__(self, tensors: dict[str, torch.Tensor], optimizer: Any, topo: Any, next_step: int = 0,
                 rng: Any = None) -> None:
        self.tensors, self.optimizer, self.topo, self.next_step = tensors, optimizer, topo, next_step
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs; tensors are this rank's live tensors (not copies)."""
        if self.rng is not None:
            rng: dict[str, Any] = self.rng.state_dict()
        else:
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"model": dict(self.tensors),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "step": self.next_step, "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content (weights copied in place, RNG set)."""
        with torch.no_grad():
            for name, value in state["model"].items():
                if value.data_ptr() != self.tensors[name].data_ptr():
                    self.tensors[name].copy_(value)
        if self.optimizer is not None and state.get("optimizer") is not None:
            groups = self.optimizer.param_groups
            self.optimizer.load_state_dict(state["optimizer"])
            # torch replaces the group dicts; keep the originals, which an optimizer may hold on to
            # (lynx.optim's bucketed optimizers read lr from them), with the loaded values
            for old, new in zip(groups, self.optimizer.param_groups):
                old.update(new)
            self.optimizer.param_groups = groups
        self.next_step = int(state["step"])
        if self.rng is not None:
            self.rng.load_state_dict(state["rng"])
            return
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def pipeline_state(pipe: Any, optimizer: Any) -> RankState:
    """The :class:`RankState` of a :class:`lynx.runtime.Pipeline`'s stage and ``optimizer``."""
    return RankState(stage_tensors(pipe.stage, pipe.attr_names), optimizer, pipe.topology, rng=pipe.rng)
