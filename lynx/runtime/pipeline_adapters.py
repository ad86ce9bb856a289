"""What :class:`lynx.runtime.Pipeline` hands its :class:`~lynx.runtime.runner.StageRunner` in place of yours.

:class:`LossStage` is the last stage as the runner drives it: the stage module, then the loss
of its output (the step's targets per microbatch beside it). :class:`StepByUser` is a bucketed
Lynx optimizer (``lynx.optim.DeMo``, ``DistributedLion``) as the runner sees it after
``Pipeline.use_optimizer``: its buckets launched during the last backward, its ``step()`` left
to your loop.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LossStage", "StepByUser"]


class LossStage:
    """The last stage as the runner drives it: the stage module, then the loss of its output."""

    def __init__(self, stage: Any, loss: Any) -> None:
        self._stage, self._loss = stage, loss
        self.targets: dict[int, tuple] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_stage", "_loss", "targets"):
            object.__setattr__(self, name, value)
        else:   # e.g. on_param_grad: the stage's own
            setattr(self._stage, name, value)

    def __call__(self, *args: Any, microbatch: int = 0) -> torch.Tensor:
        return self._loss(self._stage(*args, microbatch=microbatch), self.targets.get(microbatch, ()))


class StepByUser:
    """A bucketed optimizer as the runner sees it: buckets launched during the last backward
    (unless ``launch_early`` is False: then its ``step()`` launches them, after the step's
    gradients were checked), and ``step()`` left to the user's loop (where it finishes the
    collectives and updates)."""

    def __init__(self, inner: Any, launch_early: bool = True) -> None:
        self.inner, self.launch_early = inner, launch_early

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def launch(self, bucket: int) -> Any:
        return self.inner.launch(bucket) if self.launch_early else None

    def step(self) -> None:
        pass
