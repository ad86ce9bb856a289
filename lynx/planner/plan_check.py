"""A saved plan re-checked against the graph and hardware it names, before anything runs it.

A plan file is input: it may have been edited by hand or by a tool, or made by another
version. :func:`recheck_plan` trusts none of what it stores. It rebuilds the pipeline from the
plan's config (partition, in-flight microbatches, budget) and checks every stage's record
against it — ``layers`` and ``blocks``, ``budget_bytes``, ``in_flight``, one decision per node of
the stage and no other, windows that name a microbatch of the step and a window of the same
stage. Then it replays the decisions in the simulator (which validates them: inputs
recomputed before their consumers, windows eligible for the node's layer) and compares what
the plan predicts with the replay: per stage ``static_bytes``, ``activation_bytes``,
``peak_memory_bytes``, ``exposed_recompute_s``, ``hidden_recompute_s``, and the whole plan's
``predicted`` figures. The replay is deterministic and JSON keeps floats exactly, so a plan
written by :func:`lynx.compile` agrees to the last bit; anything beyond rounding
(``REL_TOL``) is refused, naming the stage and the field. A plan whose decisions do not fit its
budget is refused too.

Example::

    >>> import lynx
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    >>> compiled = lynx.compile(model, inputs, pp=2, microbatches=2, hardware="cpu-local", solver="heu",
    ...                         memory_budget="20MiB")
    >>> recheck_plan(compiled.plan, compiled.analysis.graph).step_time_s == compiled.plan.predicted.step_time_s
    True
    >>> stage = compiled.plan.stages[0].model_copy(update={"peak_memory_bytes": 1})
    >>> edited = compiled.plan.model_copy(update={"stages": [stage, *compiled.plan.stages[1:]]})
    >>> recheck_plan(edited, compiled.analysis.graph)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lynx.errors.LynxPlanError: plan stage 0: peak_memory_bytes is 1 but its decisions replay to ...
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from lynx.errors import LynxPlanError
from lynx.planner.problems import (
    assignment_from_decisions,
    build_pipeline,
    build_problems,
    stage_layout,
    static_bytes,
)
from lynx.planner.offload_costs import offload_decision_fields
from lynx.planner.simulator import SimResult, config_from_record, simulate_assignments
from lynx.planner.timeline import run_timeline
from lynx.units import format_size

__all__ = ["recheck_plan", "REL_TOL"]

# Relative difference (of the step time, for times) below which a stored figure is rounding
REL_TOL = 1e-9
_ADVICE = "make the plan again (`lynx plan`, or lynx.compile without plan=); plans are not edited by hand"


def recheck_plan(plan: Any, graph: nx.DiGraph) -> SimResult:
    """Refuse ``plan`` unless its records and predictions are those of its decisions on ``graph``
    (see the module docstring); returns the replay."""
    config = config_from_record(plan.config)
    pp, m = config.pp, config.microbatches
    indices = [s.index for s in plan.stages]
    if sorted(indices) != list(range(pp)):
        raise LynxPlanError(f"plan stages are {indices} but config.pp is {pp}: every stage 0..{pp - 1} once; {_ADVICE}")
    pipe = build_pipeline(graph, pp=pp, microbatches=m, schedule=config.schedule, virtual=config.virtual,
                          tp=config.tp, dp=config.dp, optimizer=config.optimizer, hardware=config.hardware_spec(),
                          offload=config.offload)
    static = static_bytes(graph, pipe, optimizer=config.optimizer)
    budget = config.budget_bytes()
    problems = build_problems(graph, pipe, run_timeline(pipe), budget_bytes=budget, static=static, tp=config.tp,
                              offload=config.offload, host_budget_bytes=config.host_budget_bytes())
    window_stage = {w.id: w.stage for w in plan.windows}
    for problem in problems:
        s = problem.stage
        stage = plan.stage(s)
        layers, names, chunks = stage_layout(graph, pipe, s)
        _as_built(s, "layers", stage.layers, layers)
        _as_built(s, "blocks", stage.blocks, names)
        if stage.chunks:   # plans before chunks were recorded have none (one chunk per device)
            _as_built(s, "chunks", stage.chunks, chunks)
        _as_built(s, "budget_bytes", stage.budget_bytes, budget)
        _as_built(s, "in_flight", stage.in_flight, problem.in_flight)
        _check_decisions(s, stage.decisions, {n.name for n in problem.nodes}, m, window_stage)
    assignments = [assignment_from_decisions(plan.stage(s).decisions, m) for s in range(pp)]
    for problem, assignment in zip(problems, assignments):   # where a streamed prefetch is issued follows
        if assignment.offload and problem.copies is not None:   # from the graph: the plan must say the same
            for d in plan.stage(problem.stage).decisions:
                if d.action == "offload":
                    _as_built(problem.stage, f"prefetch_at of {d.node!r}", d.prefetch_at,
                              offload_decision_fields(problem, assignment, d.node).get("prefetch_at"))
    try:
        sim = simulate_assignments(graph, pipe, problems, assignments, static=static, budget_bytes=budget)
    except LynxPlanError as err:
        raise LynxPlanError(f"plan {err}; {_ADVICE}") from None
    step = sim.step_time_s
    for s in range(pp):
        stage = plan.stage(s)
        _as_replayed(s, "static_bytes", stage.static_bytes, sim.static_bytes[s])
        _as_replayed(s, "activation_bytes", stage.activation_bytes, sim.activation_bytes[s])
        _as_replayed(s, "peak_memory_bytes", stage.peak_memory_bytes, sim.peak_memory_bytes[s])
        _close(f"plan stage {s}", "exposed_recompute_s", stage.exposed_recompute_s, sim.exposed_per_stage[s], step)
        _close(f"plan stage {s}", "hidden_recompute_s", stage.hidden_recompute_s, sim.hidden_per_stage[s], step)
        _as_replayed(s, "offloaded_bytes", stage.offloaded_bytes, sim.offloaded_bytes[s])
        _as_replayed(s, "host_bytes", stage.host_bytes, sim.host_bytes[s])
        _close(f"plan stage {s}", "exposed_copy_s", stage.exposed_copy_s, sim.exposed_copy_per_stage[s], step)
    p = plan.predicted
    for field, stored, replayed in (("step_time_s", p.step_time_s, step),
                                    ("exposed_recompute_s", p.exposed_recompute_s, sim.exposed_recompute_s),
                                    ("hidden_recompute_s", p.hidden_recompute_s, sim.hidden_recompute_s),
                                    ("exposed_copy_s", p.exposed_copy_s, sim.exposed_copy_s),
                                    ("bubble_s", p.bubble_s, sim.bubble_s)):
        _close("plan", f"predicted.{field}", stored, replayed, step)
    if list(p.peak_memory_bytes) != sim.peak_memory_bytes or p.fits_budget != sim.fits_budget:
        raise LynxPlanError(f"plan predicted.peak_memory_bytes / fits_budget ({p.peak_memory_bytes}, "
                            f"{p.fits_budget}) are not its decisions' ({sim.peak_memory_bytes}, {sim.fits_budget}); "
                            f"{_ADVICE}")
    host_budget = sim.host_budget_bytes
    over_host = [s for s in range(pp) if host_budget is not None and sim.host_bytes[s] > host_budget]
    if over_host and host_budget is not None:
        s = over_host[0]
        raise LynxPlanError(f"plan stage {s}: its offload needs {format_size(sim.host_bytes[s])} of pinned host "
                            f"memory, over the host_memory_budget {format_size(host_budget)} it was made for; "
                            f"make a plan that fits (solver heu or opt) or raise host_memory_budget")
    over = [s for s in range(pp) if sim.peak_memory_bytes[s] > budget]
    if over:
        s = over[0]
        raise LynxPlanError(
            f"plan stage {s}: its decisions need {format_size(sim.peak_memory_bytes[s])} "
            f"(static {format_size(sim.static_bytes[s])} + activations {format_size(sim.activation_bytes[s])}), "
            f"over the budget_bytes {format_size(budget)} it was made for; make a plan that fits (solver heu "
            f"or opt) or raise memory_budget")
    return sim


def _as_built(stage: int, field: str, stored: Any, rebuilt: Any) -> None:
    """A record the config and graph determine (before any decision)."""
    if stored != rebuilt:
        raise LynxPlanError(f"plan stage {stage}: {field} is {_short(stored)} but its config and graph give "
                            f"{_short(rebuilt)}; {_ADVICE}")


def _as_replayed(stage: int, field: str, stored: Any, replayed: Any) -> None:
    """A byte count the replay of the decisions gives exactly."""
    if stored != replayed:
        raise LynxPlanError(f"plan stage {stage}: {field} is {_short(stored)} but its decisions replay to "
                            f"{_short(replayed)}; {_ADVICE}")


def _close(where: str, field: str, stored: float, replayed: float, step: float) -> None:
    if abs(stored - replayed) > REL_TOL * max(step, 1e-30):
        raise LynxPlanError(f"{where}: {field} is {stored!r} but its decisions replay to {replayed!r}; {_ADVICE}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_decisions(stage: int, decisions: list[Any], nodes: set[str], microbatches: int,
                     window_stage: dict[str, int]) -> None:
    """One decision per node of the stage; windows for microbatches of the step, on this stage."""
    where = f"plan stage {stage}"
    seen: set[str] = set()
    for d in decisions:
        if d.node in seen:
            raise LynxPlanError(f"{where}: node {d.node!r} is decided twice; {_ADVICE}")
        seen.add(d.node)
        if d.node not in nodes:
            raise LynxPlanError(f"{where}: decides node {d.node!r}, which is not in the graph's stage {stage} "
                                f"(another model, partition or stage); {_ADVICE}")
        if d.action == "keep" and (d.window is not None or d.windows):
            raise LynxPlanError(f"{where}: node {d.node!r} is kept but given a window; {_ADVICE}")
        if d.action != "offload" and d.prefetch_at is not None:
            raise LynxPlanError(f"{where}: node {d.node!r} is not offloaded but has a prefetch_at; {_ADVICE}")
        placed = dict(d.windows or {})
        for j, wid in sorted(placed.items()):
            if not 0 <= j < microbatches:
                raise LynxPlanError(f"{where}: node {d.node!r} has a window for microbatch {j}; a step has "
                                    f"microbatches 0..{microbatches - 1}; {_ADVICE}")
        for wid in {*placed.values(), *([d.window] if d.window else [])}:
            if window_stage.get(wid, stage) != stage:
                raise LynxPlanError(f"{where}: node {d.node!r} is placed in window {wid!r} of stage "
                                    f"{window_stage[wid]}; {_ADVICE}")
    missing = sorted(nodes - seen)
    if missing:
        raise LynxPlanError(f"{where}: no decision for {len(missing)} node(s) of the stage, e.g. "
                            f"{missing[:3]}; {_ADVICE}")
