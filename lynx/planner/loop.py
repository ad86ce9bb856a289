"""The planning loop: an analysed graph and a config in, a scored :class:`~lynx.plan.Plan` out.

:func:`plan_graph` is the planning loop on an analysed graph: build the pipeline timeline,
turn its windows into one problem per stage, solve, replay the decisions in the simulator,
re-derive the windows from the replayed timeline (recomputation placed in windows moves
them) and re-solve (a stage whose plan still hides everything keeps it) — at most ``max_iterations``
times, until the decisions stop changing or
a round improves the simulated step time by less than ``CONVERGED_REL`` (0.1%) while the replay
exposes what the solvers predicted — keeping the plan the simulator scores best.

Example::

    >>> import lynx
    >>> from lynx.planner.synthetic import synthetic_graph
    >>> from lynx.planner.comm import CommModel
    >>> from lynx.planner.loop import plan_graph
    >>> cfg = lynx.CompileConfig(pp=2, microbatches=4, solver="none", memory_budget="80GiB")
    >>> plan = plan_graph(synthetic_graph(layers=4), cfg, comm=CommModel.free())
    >>> plan.predicted.fits_budget and len(plan.stages) == 2
    True
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import networkx as nx

from lynx.config import CompileConfig
from lynx.errors import LynxBudgetError, LynxPlanError
from lynx.phases import Phases
from lynx.plan import (HardwareSource, Plan, Predicted, StagePlan, WindowKind, WindowRecord, field_fingerprints,
                       fingerprint_of)
from lynx.planner.comm import CommModel
from lynx.planner.copy_lanes import HostCopies
from lynx.planner.fingerprint import graph_fingerprint
from lynx.planner.graph_schema import check_graph
from lynx.planner.problems import (
    build_pipeline,
    build_problems,
    decisions_from_assignment,
    stage_layout,
    static_breakdown,
)
from lynx.planner.simulator import SimResult, simulate_assignments
from lynx.planner.timeline import PipelineCosts, run_timeline
from lynx.solvers.offload import total_exposed_s
from lynx.solvers.problem import SolveResult, StageProblem
from lynx.solvers.setup import REGISTRY, prepare, setup_seconds
from lynx.solvers.validate import validate
from lynx.units import format_size
from lynx.viz import timeline_bars, timeline_detail

__all__ = ["plan_graph", "plan_graph_outcome", "PlanOutcome", "BUDGET_CHECKED_SOLVERS", "CONVERGED_REL"]

# Solvers that promise a plan within the budget: failing to find one is an error. Baselines
# (none, full, selective) are scored as they are and may report fits_budget=False.
BUDGET_CHECKED_SOLVERS = ("opt", "heu", "checkmate")
_STATUS_RANK = {"OPTIMAL": 0, "HEURISTIC": 1, "FEASIBLE": 2, "INFEASIBLE": 3}
# The fixed point stops when a round improves the simulated step time by less than this share
CONVERGED_REL = 1e-3


@dataclass
class PlanOutcome:
    """A plan with the objects it was made from (for benchmarks and the CLI).

    ``plan`` is None when planning was asked not to assemble one (``assemble=False``)."""

    plan: Optional[Plan]
    sim: SimResult
    pipeline: PipelineCosts
    problems: list[StageProblem]
    results: list[Any]
    search_time_s: float
    iterations: int
    phases: Phases = dataclasses.field(default_factory=Phases)  # setup, plan, search, simulate (lynx.phases)

    @property
    def status(self) -> str:
        return max((r.status for r in self.results), key=lambda st: _STATUS_RANK.get(st, 1))


def plan_graph(graph: nx.DiGraph, config: CompileConfig, *, comm: Optional[CommModel] = None,
               solve: Optional[Callable[..., Any]] = None, progress: Optional[Callable[[str], None]] = None,
               check_budget: bool = True) -> Plan:
    """Plan an analysed contract graph under ``config`` (see module docstring)."""
    plan = plan_graph_outcome(graph, config, comm=comm, solve=solve, progress=progress,
                              check_budget=check_budget).plan
    assert plan is not None  # assembled (plan_graph_outcome's default)
    return plan


def plan_graph_outcome(graph: nx.DiGraph, config: CompileConfig, *, comm: Optional[CommModel] = None,
                       solve: Optional[Callable[..., Any]] = None, progress: Optional[Callable[[str], None]] = None,
                       check_budget: bool = True, pipeline: Optional[PipelineCosts] = None,
                       assemble: bool = True) -> PlanOutcome:
    """:func:`plan_graph` returning the pipeline, problems, simulation and phase times as well
    (``assemble=False``: no Plan object, for benchmarks that only need the figures)."""
    phases = Phases()
    with phases.timed("setup"):  # before the search clock starts: importing a solver is not search
        if config.solver in REGISTRY:
            prepare(config.solver)
    if solve is None:
        from lynx.solvers import solve as registry_solve

        solve = registry_solve
    planning, prepared = time.perf_counter(), phases["setup"]
    check_graph(graph)
    say = progress or (lambda message: None)
    pipe = pipeline or build_pipeline(
        graph, pp=config.pp, microbatches=config.microbatches, schedule=config.schedule,
        virtual=config.virtual, tp=config.tp, dp=config.dp, optimizer=config.optimizer,
        comm=comm, hardware=None if comm is not None else config.hardware_spec(), offload=config.offload,
        host=HostCopies.from_hardware(config.hardware_spec(), pp=config.pp, tp=config.tp, dp=config.dp)
        if config.offload and comm is not None else None)
    budget = config.budget_bytes()
    breakdown = static_breakdown(graph, pipe, optimizer=config.optimizer)
    static = [sum(parts.values()) for parts in breakdown]
    if check_budget and config.solver in BUDGET_CHECKED_SOLVERS and max(static) > budget:
        raise LynxBudgetError(_static_message(config, budget, breakdown))
    timeline = run_timeline(pipe, record=False)
    best: Optional[tuple[tuple, SimResult, list[StageProblem], list[Any]]] = None
    previous = previous_results = None
    search_time, iterations = 0.0, 0
    problems: list[StageProblem] = []
    offload = config.offload   # (off once the plans without offload score better: _without_offload)
    refitted = False   # (the offload plans got a second round after missing the budget)
    for iteration in range(config.max_iterations):
        iterations = iteration + 1
        problems = build_problems(graph, pipe, timeline, budget_bytes=budget, static=static, tp=config.tp,
                                  previous=problems if iteration else None,  # (same nodes: reused)
                                  offload=offload, host_budget_bytes=config.host_budget_bytes())
        results = []
        try:
            for index, problem in enumerate(problems):
                started, imported = time.perf_counter(), setup_seconds()
                try:
                    kept = _still_hidden(problem, previous_results[index] if previous_results else None)
                    if kept:  # nothing to gain on this stage: its plan still hides everything
                        results.append(kept)
                        continue
                    say(f"iteration {iterations}: solving stage {problem.stage} with {config.solver} "
                        f"({len(problem.nodes)} nodes, {len(problem.windows)} windows)")
                    results.append(solve(config.solver, problem, time_limit_s=config.time_limit_s))
                finally:  # a solver's first import of CP-SAT is setup (lynx.solvers.setup), not search
                    first_imports = setup_seconds() - imported
                    search_time += time.perf_counter() - started - first_imports
                    phases.add("setup", first_imports)
        except LynxBudgetError as err:
            if best is not None:  # a later iteration's windows cannot make memory worse; keep the best
                break
            raise LynxBudgetError(
                f"no {config.solver} plan fits memory_budget {format_size(budget)} per device: "
                f"{_static_line(breakdown, problem.stage)} leave {format_size(problem.activation_budget_bytes)} "
                f"for activations; {err}") from None
        assignments = [r.assignment for r in results]
        with phases.timed("simulate"):
            sim = simulate_assignments(graph, pipe, problems, assignments, static=static, budget_bytes=budget,
                                       record=False)
        score = (not sim.fits_budget, round(sim.step_time_s, 12), max(sim.peak_memory_bytes))
        converged = best is not None and _converged(best[0], score) and _replay_agrees(results, sim)
        if best is None or score < best[0]:
            best = (score, sim, problems, results)
        plain = _without_offload(results)
        if plain is not None:   # the solvers' plans without offload, scored on the whole pipeline too
            with phases.timed("simulate"):
                alt = simulate_assignments(graph, pipe, problems, [r.assignment for r in plain], static=static,
                                           budget_bytes=budget, record=False)
            alt_score = (not alt.fits_budget, round(alt.step_time_s, 12), max(alt.peak_memory_bytes))
            if alt_score < best[0] and not sim.fits_budget and not refitted:
                # the offload plans' peaks missed by the copies still pending, which this round's
                # problems estimated from a replay without them: once more, from this replay
                best, refitted = (alt_score, alt, problems, plain), True
                previous, previous_results, timeline = assignments, results, sim.timeline
                continue
            if alt_score < best[0]:   # better on the pipeline: the next rounds go on without offload
                best, offload = (alt_score, alt, problems, plain), False
                previous, previous_results, timeline = [r.assignment for r in plain], plain, alt.timeline
                continue
        if assignments == previous or converged:
            break
        if not any(a.recompute or a.offload for a in assignments):
            break  # nothing recomputed or offloaded: the replay's windows are the ones just solved for
        previous, previous_results = assignments, results
        timeline = sim.timeline  # windows re-derived from the replay
    assert best is not None
    _, sim, problems, results = best
    if check_budget and config.solver in BUDGET_CHECKED_SOLVERS and not sim.fits_budget:
        raise LynxBudgetError(_budget_message(graph, pipe, config, problems, sim, breakdown, solve))
    plan = None
    if assemble:  # the chosen plan once more, with drawing segments for the plan's timeline picture
        with phases.timed("simulate"):
            sim = simulate_assignments(graph, pipe, problems, [r.assignment for r in results], static=static,
                                       budget_bytes=budget, check=False)
        plan = _assemble(graph, config, pipe, problems, results, sim, search_time, iterations)
    # The rest of the loop's time is the planner's own work: partition, timelines, problems, the plan object.
    first_imports = phases["setup"] - prepared
    phases.add("plan", time.perf_counter() - planning - search_time - phases.get("simulate", 0.0) - first_imports)
    phases.add("search", search_time)
    return PlanOutcome(plan=plan, sim=sim, pipeline=pipe, problems=problems, results=results,
                       search_time_s=search_time, iterations=iterations, phases=phases)


def _assemble(graph: nx.DiGraph, config: CompileConfig, pipe: PipelineCosts, problems: list[StageProblem],
              results: list[Any], sim: SimResult, search_time: float, iterations: int) -> Plan:
    record = config.record()
    fields = config.fingerprint_fields()
    record.update(fields)
    graph_fp = graph_fingerprint(graph)
    stages = []
    for s, (problem, result) in enumerate(zip(problems, results)):
        layers, names, chunks = stage_layout(graph, pipe, s)
        stages.append(StagePlan(
            index=s, layers=layers, blocks=names,
            budget_bytes=sim.budget_bytes, peak_memory_bytes=sim.peak_memory_bytes[s],
            static_bytes=sim.static_bytes[s], activation_bytes=sim.activation_bytes[s],
            in_flight=problem.in_flight, exposed_recompute_s=sim.exposed_per_stage[s],
            hidden_recompute_s=sim.hidden_per_stage[s], offloaded_bytes=sim.offloaded_bytes[s],
            host_bytes=sim.host_bytes[s], exposed_copy_s=sim.exposed_copy_per_stage[s],
            chunks=chunks,
            decisions=decisions_from_assignment(problem, result.assignment)))
    # a problem window's kind is one of WindowRecord's (planner.windows.WINDOW_KINDS); pydantic checks it
    windows = [WindowRecord(id=str(w.id), stage=p.stage, kind=cast(WindowKind, w.kind), microbatch=w.microbatch,
                            capacity_s=w.capacity_s,
                            eligible_layers=None if w.eligible_layers is None else list(w.eligible_layers))
               for p in problems for w in p.windows]
    status = max((r.status for r in results), key=lambda st: _STATUS_RANK.get(st, 1))
    gaps = [r.gap for r in results if r.gap is not None]
    return Plan(
        fingerprint=fingerprint_of(graph_fp, fields), graph_fingerprint=graph_fp, config=record,
        solver=config.solver, status=status, gap=max(gaps) if gaps else None, search_time_s=search_time,
        iterations=iterations, stages=stages, windows=windows,
        predicted=Predicted(step_time_s=sim.step_time_s, exposed_recompute_s=sim.exposed_recompute_s,
                            hidden_recompute_s=sim.hidden_recompute_s, exposed_copy_s=sim.exposed_copy_s,
                            bubble_s=sim.bubble_s,
                            peak_memory_bytes=sim.peak_memory_bytes, fits_budget=sim.fits_budget),
        timeline=timeline_bars(sim.timeline), timeline_detail=timeline_detail(sim.timeline),
        config_fingerprints=field_fingerprints(fields), hardware_source=HardwareSource.of(config.hardware_spec()))


def _still_hidden(problem: StageProblem, result: Optional[SolveResult]) -> Optional[SolveResult]:
    """The previous round's result for this stage when it is still valid on the re-derived
    windows and exposes nothing there (no solver can do better: the objective is 0 and
    memory does not depend on window capacities), else None."""
    if result is None or result.objective_s > 0:  # (the solver's estimate first: cheap)
        return None
    try:
        validate(problem, result.assignment)
    except LynxPlanError:
        return None
    if total_exposed_s(problem, result.assignment) > 0:
        return None
    return dataclasses.replace(result, search_time_s=0.0)


def _without_offload(results: list[Any]) -> Optional[list[Any]]:
    """The round's results with each stage's plan without offload where its solver found one
    (``SolveResult.without_offload``), or None where none did. A stage's objective (exposed
    recompute plus copy time) cannot see that a backward that copies or recomputes on demand
    runs whole, its input gradients sent after its weight part (``PipelineCosts.grads_first``),
    so a plan that offloads can be slower on the pipeline than the one without it."""
    if not any(getattr(r, "without_offload", None) is not None for r in results):
        return None
    return [r.without_offload if getattr(r, "without_offload", None) is not None else r for r in results]


def _converged(best: tuple, score: tuple) -> bool:
    """A later round that fits, after a fitting best, and improves the step time by less than
    ``CONVERGED_REL``: the fixed point has settled (a further round moves windows by the
    same small amounts; what a third round gains over the default grid: ``docs/planner.md``)."""
    return not best[0] and not score[0] and score[1] > best[1] * (1 - CONVERGED_REL)


def _replay_agrees(results: list[Any], sim: SimResult) -> bool:
    """Whether the replay exposes, stage by stage, what the solvers predicted on the windows
    they were given (within ``CONVERGED_REL`` of the step time): the windows no longer move
    under the plan. A small gain alone does not settle it — a round can gain little while
    its windows are still far from the plan's and the next round gains more (with 32
    microbatches, neighbouring stages' windows take several rounds: ``docs/planner.md``)."""
    tolerance = CONVERGED_REL * sim.step_time_s
    copies = getattr(sim, "exposed_copy_per_stage", None) or [0.0] * len(results)
    return all(abs(exposed + copy - result.objective_s) <= tolerance
               for exposed, copy, result in zip(sim.exposed_per_stage, copies, results))


def _static_line(breakdown: list[dict[str, int]], stage: int) -> str:
    parts = breakdown[stage]
    return (f"stage {stage}'s weights {format_size(parts['weights'])}, gradients {format_size(parts['gradients'])} "
            f"and optimizer state {format_size(parts['optimizer'])}")


def _static_message(config: CompileConfig, budget: int, breakdown: list[dict[str, int]]) -> str:
    worst = max(range(len(breakdown)), key=lambda s: sum(breakdown[s].values()))
    need = sum(breakdown[worst].values())
    return (f"memory_budget {format_size(budget)} per device is below the static memory alone: "
            f"{_static_line(breakdown, worst)} need {format_size(need)} before any activation. Raise "
            f"memory_budget above {format_size(need)}, raise pp or tp, or use optimizer='demo' or 'lion'.")


def _budget_message(graph: nx.DiGraph, pipe: PipelineCosts, config: CompileConfig, problems: list[StageProblem],
                    sim: SimResult, breakdown: list[dict[str, int]], solve: Callable[..., Any]) -> str:
    """Say what the leanest plan needs per stage and what dominates it."""
    peaks = list(sim.peak_memory_bytes)
    activations = list(sim.activation_bytes)
    try:  # full recomputation is usually the leanest plan there is
        full = [solve("full", p, time_limit_s=config.time_limit_s).assignment for p in problems]
        full_sim = simulate_assignments(graph, pipe, problems, full, static=sim.static_bytes,
                                        budget_bytes=sim.budget_bytes, check=False)
        for s, peak in enumerate(full_sim.peak_memory_bytes):
            if peak < peaks[s]:
                peaks[s], activations[s] = peak, full_sim.activation_bytes[s]
    except Exception:  # noqa: BLE001 - the message is still useful without it
        pass
    lines = []
    for s, peak in enumerate(peaks):
        parts = dict(breakdown[s], activations=activations[s])
        dominant = max(parts, key=parts.__getitem__)
        detail = ", ".join(f"{k} {format_size(v)}" for k, v in parts.items())
        lines.append(f"stage {s}: {format_size(peak)} ({detail}; mostly {dominant}, "
                     f"{problems[s].in_flight} microbatch(es) in flight)")
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    dominant = max(dict(breakdown[worst], activations=activations[worst]).items(), key=lambda kv: kv[1])[0]
    advice = {"activations": "raise pp or tp, or use fewer microbatches in flight (gpipe holds all m)",
              "optimizer": "use optimizer='demo' or 'lion' (one momentum instead of two), or raise pp or tp",
              "weights": "raise pp or tp", "gradients": "raise pp or tp"}[dominant]
    return (f"no {config.solver} plan fits memory_budget {format_size(sim.budget_bytes)} per device; "
            f"the leanest plan found needs " + "; ".join(lines)
            + f". Raise memory_budget to at least {format_size(peaks[worst])}, or {advice}.")

