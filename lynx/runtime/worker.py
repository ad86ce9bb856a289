"""What every rank of a run builds: the :class:`WorkerSpec` and the stage it cuts out of the model.

:func:`stage_setup` captures the model (checking a plan against it first), splits the graph
into the plan's stages and builds this rank's stage module with the plan's drops;
:func:`rank_seed` is the seed each (stage, replica) draws its dropout masks from. Both the
launcher (:mod:`lynx.runtime.launch`) and one rank's training state
(:mod:`lynx.runtime.trainer`) use them.

Example::

    >>> from lynx.runtime.worker import rank_seed
    >>> rank_seed(0, stage=1, dp_rank=0), rank_seed(0, stage=0, dp_rank=1)
    (1, 1009)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lynx.errors import LynxConfigError
from lynx.runtime.pipeline import RuntimeConfig
from lynx.runtime.topology import rank_device

__all__ = ["WorkerSpec", "Batches", "rank_seed", "stage_setup"]

Batches = Callable[[int, int, int], Sequence[dict[str, torch.Tensor]]]  # (step, dp_rank, microbatches)


@dataclass
class WorkerSpec:
    build: Callable[[], tuple[torch.nn.Module, tuple]]   # same model on every rank (seed inside)
    pp: int
    dp: int = 1
    runtime: RuntimeConfig | list[RuntimeConfig] = field(default_factory=RuntimeConfig)  # several: run each in turn
    plan: Any = None                      # lynx.Plan or path: stages, drops and windows
    stage_nodes: list[list[str]] | None = None   # without a plan: the split ...
    schedules: list[Any] | None = None    # ... and per stage a StageSchedule (dropped, prefetch) or None
    batches: Batches | None = None        # microbatches of (step, dp_rank); default: the example inputs
    steps: int = 1
    seed: int = 0
    threads: int = 1
    optimizer: Callable[[list, Any], Any] | None = None  # (stage params, dp group) -> optimizer
    return_grads: bool = False
    fail_rank: int | None = None          # fault injection for tests: this rank raises in step 0
    fingerprint: str | dict[int, str] | None = None  # plan fingerprint per rank (default: the plan's)
    compile_settings: dict[str, Any] = field(default_factory=dict)
    lr_schedule: Callable[[int], float] | None = None  # step -> learning rate of every param group
    compile: bool = False                 # torch.compile each stage's generated graphs (or the plan says so)


def rank_seed(seed: int, stage: int, dp_rank: int) -> int:
    """The RNG seed of the rank running ``stage`` of replica ``dp_rank`` (dropout draws)."""
    return seed + 1009 * dp_rank + stage


def stage_setup(spec: WorkerSpec, model: torch.nn.Module, inputs: tuple,
                 stage: int) -> tuple[Any, Any, list[set[str]], list[str]]:
    """The stage module, its schedule, every stage's parameter names and the model's input names."""
    from lynx.frontend.capture import capture
    from lynx.rewrite.build import build_stages, split_cached, stage_node_lists

    device = rank_device()  # CUDA under NCCL: the model moves before the stage is cut out of it
    if device.type != "cpu":
        model = model.to(device)
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    if spec.plan is not None:
        import lynx
        from lynx.plan import Plan

        from lynx.config import FINGERPRINT_FIELDS

        plan = spec.plan if isinstance(spec.plan, Plan) else Plan.load(spec.plan)
        settings = spec.compile_settings or {k: plan.config[k] for k in FINGERPRINT_FIELDS if k in plan.config}
        # refuses a plan made for another model or settings, before anything runs
        compiled = lynx.compile(model, inputs, plan=plan, **settings)
        gm = compiled.analysis.captured.gm
        nodes = stage_node_lists(plan, compiled.analysis.graph)
        schedule = plan.stage_schedule(stage)
        dropped = schedule.dropped
    else:
        if spec.stage_nodes is None:
            raise LynxConfigError("WorkerSpec needs a plan or stage_nodes")
        gm = capture(model, inputs).gm
        nodes = spec.stage_nodes
        schedule = spec.schedules[stage] if spec.schedules else None
        dropped = schedule.dropped if schedule is not None else frozenset()
    if len(nodes) != spec.pp:
        raise LynxConfigError(f"the split has {len(nodes)} stages but pp={spec.pp}")
    parts = split_cached(gm, nodes)
    names = [{str(n.target) for n in part.gm.graph.nodes if n.op == "get_attr"} for part in parts]
    use_compile = spec.compile or bool(spec.plan is not None and plan.config.get("compile", False))
    stage_module = build_stages(gm, nodes, [frozenset() if s != stage else dropped for s in range(spec.pp)],
                                compile=use_compile)[stage]
    input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return stage_module, schedule, names, input_names
