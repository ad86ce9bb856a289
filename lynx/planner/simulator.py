"""The simulator: replays recomputation decisions on the pipeline timeline and scores them.

Recomputation placed in a window runs in that window's idle time; what does not fit, and all
on-demand recomputation, lengthens the backward it belongs to and — through the pipeline's
send/receive dependencies — shifts everything downstream. The replay gives the step time,
exposed and hidden recomputation, bubble time and peak memory per stage (static memory plus
:func:`lynx.solvers.memory.peak_activation_bytes`). Every solver and baseline is scored here;
no solver's own objective is trusted.

Example::

    >>> from lynx.planner.problems import build_pipeline, build_problems, static_bytes
    >>> from lynx.planner.synthetic import synthetic_graph
    >>> from lynx.planner.comm import CommModel
    >>> from lynx.planner.timeline import run_timeline
    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.planner.simulator import simulate_assignments
    >>> g = synthetic_graph(layers=4)
    >>> pipe = build_pipeline(g, pp=2, microbatches=4, comm=CommModel.free())
    >>> static = static_bytes(g, pipe, optimizer="adamw")
    >>> problems = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40, static=static)
    >>> keep = [Assignment(recompute=frozenset()) for _ in problems]
    >>> sim = simulate_assignments(g, pipe, problems, keep, static=static, budget_bytes=2**40)
    >>> sim.exposed_recompute_s, sim.fits_budget
    (0.0, True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import networkx as nx

from lynx.errors import LynxPlanError
from lynx.planner.problems import (
    assignment_from_decisions,
    build_pipeline,
    build_problems,
    loads_from_assignments,
    static_bytes,
)
from lynx.solvers.offload import host_bytes
from lynx.solvers.problem import Assignment, StageProblem, group_key, group_ranks
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.validate import validate
from lynx.planner.timeline import PipelineCosts, Timeline, run_timeline

__all__ = ["SimResult", "simulate_assignments", "simulate", "config_from_record"]


@dataclass(frozen=True)
class SimResult:
    """What one replay of a plan gives."""

    step_time_s: float
    exposed_recompute_s: float                 # summed over stages, one training step
    hidden_recompute_s: float
    bubble_s: float                            # mean over stages of step time not computing
    peak_memory_bytes: list[int]               # per stage: static + activations
    static_bytes: list[int]
    activation_bytes: list[int]
    exposed_per_stage: list[float]
    hidden_per_stage: list[float]
    budget_bytes: int
    timeline: Timeline
    # offload (empty or zeros without): per stage, seconds backwards waited on prefetches, bytes
    # offloaded per microbatch, pinned host memory held at most, and the host budget
    exposed_copy_per_stage: list[float] = dataclasses.field(default_factory=list)
    offloaded_bytes: list[int] = dataclasses.field(default_factory=list)
    host_bytes: list[int] = dataclasses.field(default_factory=list)
    host_budget_bytes: Optional[int] = None

    @property
    def fits_budget(self) -> bool:
        device = all(p <= self.budget_bytes for p in self.peak_memory_bytes)
        host = self.host_budget_bytes is None or all(h <= self.host_budget_bytes for h in self.host_bytes)
        return device and host

    @property
    def exposed_copy_s(self) -> float:
        """Seconds the step's backwards waited on prefetches (summed over stages)."""
        return sum(self.exposed_copy_per_stage)

    @property
    def recompute_s(self) -> float:
        return self.exposed_recompute_s + self.hidden_recompute_s

    @property
    def hidden_fraction(self) -> float:
        """Share of recomputation time hidden in windows (1.0 when nothing is recomputed)."""
        return self.hidden_recompute_s / self.recompute_s if self.recompute_s > 0 else 1.0


def simulate_assignments(graph: nx.DiGraph, pipe: PipelineCosts, problems: list[StageProblem],
                         assignments: list[Assignment], *, static: list[int], budget_bytes: int,
                         check: bool = True, record: bool = True) -> SimResult:
    """Replay per-stage assignments on ``pipe``; ``check`` validates each against its problem;
    ``record=False`` leaves the timeline's drawing segments out (faster)."""
    if len(assignments) != len(problems):
        raise LynxPlanError(f"{len(assignments)} stage assignments for {len(problems)} stages")
    timeline = run_timeline(pipe, loads_from_assignments(graph, pipe, problems, assignments), record=record)
    if check:
        for problem, assignment in zip(problems, assignments):
            validate(_windows_of(problem, timeline), assignment)
    # the plan's saved activations, and what the stage sends that nobody saves (held anyway); with
    # offload, what other microbatches' copies to the host still hold, as this replay has them
    activation = [peak_activation_bytes(p, a, _pending(graph, p, timeline) if a.offload else None)
                  + p.in_flight * p.sent_bytes for p, a in zip(problems, assignments)]
    peak = [st + act for st, act in zip(static, activation)]
    bubble = timeline.bubble_s
    return SimResult(
        step_time_s=timeline.step_time_s,
        exposed_recompute_s=sum(timeline.exposed_recompute_s),
        hidden_recompute_s=sum(timeline.hidden_recompute_s),
        bubble_s=sum(bubble) / len(bubble),
        peak_memory_bytes=peak, static_bytes=list(static), activation_bytes=activation,
        exposed_per_stage=list(timeline.exposed_recompute_s), hidden_per_stage=list(timeline.hidden_recompute_s),
        budget_bytes=budget_bytes, timeline=timeline,
        exposed_copy_per_stage=list(timeline.exposed_copy_s) or [0.0] * len(problems),
        offloaded_bytes=[sum(n.saved_bytes for n in p.nodes if n.name in a.offload)
                         for p, a in zip(problems, assignments)],
        host_bytes=[host_bytes(p, a) for p, a in zip(problems, assignments)],
        host_budget_bytes=min((p.copies.host_budget_bytes for p in problems if p.copies is not None), default=None))


def _pending(graph: nx.DiGraph, problem: StageProblem, timeline: Timeline) -> list[int]:
    """Per group rank of the stage, the replay's most bytes of other microbatches' device→host
    copies not done when that group's backward starts."""
    by_block = timeline.pending_bytes[problem.stage] if problem.stage < len(timeline.pending_bytes) else {}
    ranks = group_ranks(problem)
    out = [0] * len(ranks)
    for n in problem.nodes:
        g = ranks[group_key(n)]
        out[g] = max(out[g], by_block.get(int(graph.nodes[n.name]["block"]), 0))
    return out


def _windows_of(problem: StageProblem, timeline: Timeline) -> StageProblem:
    """The problem with every window the replay has on its stage (zero-capacity ones too:
    a plan may use a window that has closed since it was made; it then simply overflows)."""
    from lynx.solvers.problem import ProblemWindow

    windows = tuple(ProblemWindow(id=w.id, kind=w.kind, microbatch=w.microbatch, capacity_s=w.capacity_s,
                                  eligible_layers=w.eligible_layers)
                    for w in timeline.windows if w.device == problem.stage)
    return dataclasses.replace(problem, windows=windows)


def config_from_record(record: dict[str, Any]) -> Any:
    """The :class:`lynx.CompileConfig` a plan's ``config`` record describes."""
    from lynx.config import CompileConfig

    data = {k: v for k, v in record.items() if k in CompileConfig.model_fields}
    if isinstance(data.get("hardware"), dict):
        from lynx.planner.hardware import HardwareSpec

        data["hardware"] = HardwareSpec(**data["hardware"])
    return CompileConfig(**data)


def simulate(plan: Any, graph: Optional[nx.DiGraph] = None) -> SimResult:
    """Replay a :class:`lynx.Plan` (or a :class:`lynx.Compiled`) on the graph it was made for.

    ``graph`` defaults to the compiled object's analysis graph. Windows are re-derived from the
    plan's config (hardware, schedule, parallelism), so a plan is scored independently of the
    figures stored in it.
    """
    if hasattr(plan, "plan") and hasattr(plan, "analysis"):
        graph = graph if graph is not None else plan.analysis.graph
        plan = plan.plan
    if graph is None:
        raise LynxPlanError("simulate(plan, graph): the graph the plan was made for is needed")
    config = config_from_record(plan.config)
    pipe = build_pipeline(graph, pp=config.pp, microbatches=config.microbatches, schedule=config.schedule,
                          virtual=config.virtual, tp=config.tp, dp=config.dp, optimizer=config.optimizer,
                          hardware=config.hardware_spec(), offload=config.offload)
    static = static_bytes(graph, pipe, optimizer=config.optimizer)
    budget = config.budget_bytes()
    problems = build_problems(graph, pipe, run_timeline(pipe), budget_bytes=budget, static=static, tp=config.tp,
                              offload=config.offload, host_budget_bytes=config.host_budget_bytes())
    assignments = [assignment_from_decisions(plan.stage(s).decisions, config.microbatches)
                   for s in range(config.pp)]
    for problem, stage_plan in zip(problems, (plan.stage(s) for s in range(config.pp))):
        planned = {d.node for d in stage_plan.decisions}
        if planned != {n.name for n in problem.nodes}:
            raise LynxPlanError(f"plan stage {problem.stage} decides other nodes than the graph's stage "
                                f"{problem.stage}: the plan was made for another model or partition")
    return simulate_assignments(graph, pipe, problems, assignments, static=static, budget_bytes=budget)

