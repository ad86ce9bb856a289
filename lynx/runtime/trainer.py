"""One rank's training state, stepped one step at a time: model stage, runner, optimizer, RNG.

:class:`RankTrainer` is built once per rank from a :class:`~lynx.runtime.launch.WorkerSpec`:
it builds the model (same seed on every rank), cuts out and rewrites this rank's pipeline
stage from the plan, makes the optimizer over the stage's parameters and the data-parallel
group, and a :class:`~lynx.runtime.pipeline.PipelineRunner`. :meth:`RankTrainer.step` runs
one training step of the data the step index selects (the data position of a run is its
step). :meth:`RankTrainer.state_dict` holds everything a bitwise-exact resume needs — the
stage's parameters and buffers, the optimizer state, the next step and the RNG states (CPU,
and CUDA when present) — as tensors plus small plain values (see
:mod:`lynx.runtime.checkpoint`). :func:`lynx.runtime.launch.run_rank` is a loop over it.

Example (inside an initialised process group, e.g. under ``torchrun``)::

    trainer = RankTrainer(spec, make_topology(spec.pp, spec.dp))
    for step in range(spec.steps):
        stats = trainer.step(step)          # StepStats; losses on the last stage
    state = trainer.state_dict()
    trainer.close()
"""

from __future__ import annotations

from typing import Any

import torch

from lynx.runtime.worker import WorkerSpec, rank_seed, stage_setup
from lynx.runtime.pipeline import PipelineRunner, RuntimeConfig
from lynx.runtime.rank_state import RankState, stage_tensors
from lynx.runtime.stats import StepStats
from lynx.runtime.topology import Topology, tied_groups

__all__ = ["RankTrainer"]


class RankTrainer:
    """This rank's stage of the pipeline, trained one step at a time (see module docstring)."""

    def __init__(self, spec: WorkerSpec, topo: Topology, runtime: RuntimeConfig | None = None) -> None:
        self.spec, self.topo = spec, topo
        torch.manual_seed(spec.seed)  # the same initial weights on every rank
        model, inputs = spec.build()
        model.train()
        self.stage, self.schedule, self.stage_param_names, self.input_names = stage_setup(
            spec, model, inputs, topo.stage)
        self.example_inputs = inputs
        self.tied = tied_groups(topo, self.stage_param_names)
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        self.tensors = stage_tensors(self.stage, self.stage_param_names[topo.stage])
        self.runner: PipelineRunner | None = None
        self.optimizer: Any = None
        self.next_step = 0
        first = spec.runtime[0] if isinstance(spec.runtime, list) else spec.runtime
        self.start(runtime or first)

    # ------------------------------------------------------------------ running
    @property
    def dp_group(self) -> Any:
        """The data-parallel group; with dp = 1 a group of this rank alone (never the world)."""
        if self.topo.dp_group is not None:
            return self.topo.dp_group
        return self.topo.mesh.get_group("dp") if self.topo.mesh is not None else None

    def start(self, runtime: RuntimeConfig) -> None:
        """(Re)build the optimizer and runner for ``runtime`` and seed this rank's RNG."""
        self.close()
        self.runtime = runtime
        self.optimizer = self.spec.optimizer(self.params, self.dp_group) if self.spec.optimizer else None
        self.runner = PipelineRunner(self.stage, self.topo, runtime, schedule=self.schedule,
                                     optimizer=self.optimizer, tied=self.tied)
        torch.manual_seed(rank_seed(self.spec.seed, self.topo.stage, self.topo.dp_rank))
        self.next_step = 0

    def batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        m = self.runtime.microbatches
        if self.spec.batches is not None:
            return list(self.spec.batches(step, self.topo.dp_rank, m))
        return [dict(zip(self.input_names, self.example_inputs))] * m

    def step(self, step: int | None = None) -> StepStats:
        """Train step ``step`` (default: the next one) and return what this rank measured."""
        step = self.next_step if step is None else step
        if self.spec.fail_rank == self.topo.rank and step == 0:
            raise RuntimeError(f"injected failure on rank {self.topo.rank}")
        if self.optimizer is not None and self.spec.lr_schedule is not None:
            lr = self.spec.lr_schedule(step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        assert self.runner is not None
        stats = self.runner.step(self.batches(step))
        self.next_step = step + 1
        return stats

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.stage.gm.named_parameters() if p.grad is not None}

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs (:class:`~lynx.runtime.rank_state.RankState`)."""
        return RankState(self.tensors, self.optimizer, self.topo, self.next_step).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content (weights copied in place, RNG set)."""
        resumed = RankState(self.tensors, self.optimizer, self.topo)
        resumed.load_state_dict(state)
        self.next_step = resumed.next_step
