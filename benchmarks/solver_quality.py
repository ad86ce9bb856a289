"""OPT vs HEU: search time and plan quality on gpt-1.3b … gpt-20b sized pipeline stages.

Two sets of stage problems, each at a budget 30% of the way from Megatron-full's peak to
keep-all's peak (``--level``):

* synthetic: :func:`lynx.solvers.problem.make_uniform_problem` stages of pp=4 stage 0 (the
  stage holding 4 microbatches) with the models' hidden size, heads and layers per stage;
  windows: the warm-up wait before microbatch 0 (≈ 3 stages × (F + B)), a short cool-down
  wait for the last 3 microbatches, and with tp=2 a tensor-parallel all-reduce window per
  layer of every backward;
* real: the StageProblems the planner builds (``lynx.planner.loop.plan_graph_outcome``) from the
  captured and profiled model (meta device, h100-sxm, pp=4, 1F1B, tp=1).

For each: HEU's search time (median of ``--repeats`` runs), OPT's status, time and gap, both
plans' exposed recompute, and HEU's excess over OPT relative to a 1F1B step-time proxy
``(m + p − 1) · 3 · F`` (F = the stage's forward time).

* sweep (``--sections sweep``): whole plans — the planner's fixed point, scored by the
  simulator — with HEU and with OPT over models (``gpt-tiny``, ``llama-tiny``, ``gpt-1.3b``,
  ``gpt-2.7b``), pp, tp, microbatches, schedules and budget levels from `full`'s peak to near
  `none`'s (OPT at most 10 s per stage solve there). Per point: both step times, HEU's relative
  step-time excess (the issue's bar: ≤ 1% on every point), whether OPT proved every stage OPTIMAL,
  and per stage (the first round's problems, solved by both) HEU's excess exposed recompute over
  OPT's, in ms and relative to OPT's step time.

    .venv/bin/python benchmarks/solver_quality.py                  # all sections, ~40 min on 2 busy cores
    .venv/bin/python benchmarks/solver_quality.py --sections sweep --opt-time-limit 10
    .venv/bin/python benchmarks/solver_quality.py --no-real --opt-time-limit 10
    .venv/bin/python benchmarks/solver_quality.py --sections sweep --offload   # both deciding offload too

Writes benchmarks/results/solver_quality.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx.errors import LynxError  # noqa: E402
from lynx.solvers import solve  # noqa: E402
from lynx.solvers.problem import Assignment, StageProblem, exposed_recompute_s
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.memory import peak_activation_bytes

# name: (hidden, heads, layers)
MODELS = {
    "gpt-1.3b": (2048, 16, 24),
    "gpt-2.7b": (2560, 32, 32),
    "gpt-6.7b": (4096, 32, 32),
    "gpt-13b": (5120, 40, 40),
    "gpt-20b": (6144, 64, 44),
}
PP = 4


def at_level(problem: StageProblem, level: float) -> StageProblem:
    none = peak_activation_bytes(problem, Assignment(frozenset(), {}))
    full = peak_activation_bytes(problem, solve("full", problem).assignment)
    return dataclasses.replace(problem, activation_budget_bytes=int(full + level * (none - full)))


def synthetic(model: str, microbatches: int, tp: int, level: float) -> StageProblem:
    hidden, heads, layers = MODELS[model]
    per_stage = -(-layers // PP)
    shape = dict(layers=per_stage, hidden=hidden // tp, heads=heads // tp, seq=2048, microbatches=microbatches,
                 in_flight=min(PP, microbatches), views=True)
    base = make_uniform_problem(**shape)
    forward = sum(n.recompute_s for n in base.nodes)
    caps = [3 * 3 * forward] + [0.0] * (microbatches - 4) + [forward / 4] * 3
    problem = make_uniform_problem(
        **shape,
        recv_grad_capacity_s=caps,
        tp_capacity_s=0.05 * forward / per_stage if tp > 1 else 0.0,
    )
    return at_level(problem, level)


def real_problems(model: str, microbatches: int, level: float) -> list[StageProblem]:
    from lynx.frontend.analyze import analyze
    from lynx.planner.loop import plan_graph_outcome
    from lynx.config import CompileConfig
    from lynx.models import resolve_model

    started = time.perf_counter()
    resolved = resolve_model(model)
    graph = analyze(resolved.model, resolved.example_inputs, target="cuda", hardware="h100-sxm").graph
    cfg = CompileConfig(
        pp=PP, microbatches=microbatches, tp=1, hardware="h100-sxm", solver="full", memory_budget="1000GiB"
    )
    problems = plan_graph_outcome(graph, cfg, check_budget=False, assemble=False).problems
    print(
        f"  {model}: analysed and built {len(problems)} stage problems in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return [at_level(p, level) for p in problems]


def measure(problem: StageProblem, repeats: int, opt_limit: float | None) -> dict:
    from lynx.solvers.heu.solve import clear_cache

    times, cpu = [], []
    for _ in range(repeats):
        clear_cache()  # cold: HEU caches a stage's structure for the planner's fixed point
        started, started_cpu = time.perf_counter(), time.process_time()
        heu = solve("heu", problem)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    forward = sum(n.recompute_s for n in problem.nodes)
    step = (problem.microbatches + PP - 1) * 3 * forward
    row = {
        "nodes": len(problem.nodes),
        "windows": len(problem.windows),
        "m": problem.microbatches,
        "heu_s": statistics.median(times),
        "heu_cpu_s": statistics.median(cpu),
        "heu_exposed_ms": exposed_recompute_s(problem, heu.assignment) * 1e3,
        "full_exposed_ms": solve("full", problem).objective_s * 1e3,
        "step_proxy_ms": step * 1e3,
    }
    if opt_limit:
        try:
            opt = solve("opt", problem, time_limit_s=opt_limit)
            opt_exposed = exposed_recompute_s(problem, opt.assignment)
            row.update(
                opt_status=opt.status,
                opt_s=opt.search_time_s,
                opt_gap=opt.gap,
                opt_exposed_ms=opt_exposed * 1e3,
                heu_excess_of_step=(exposed_recompute_s(problem, heu.assignment) - opt_exposed) / step,
            )
        except LynxError as err:
            row.update(opt_status=f"error: {err}")
    return row


def fmt(row: dict, label: str) -> str:
    opt = (
        f"{row['opt_status']:8s} {row['opt_s']:7.2f} s gap {row['opt_gap']:.4f} | "
        f"{row['opt_exposed_ms']:8.3f} ms | {100 * row['heu_excess_of_step']:6.3f} %"
        if "opt_s" in row
        else f"{row.get('opt_status', '-'):8s}"
    )
    return (
        f"| {label} | {row['nodes']} | {row['windows']} | "
        f"{1e3 * row['heu_s']:6.1f} / {1e3 * row['heu_cpu_s']:5.1f} ms | "
        f"{row['heu_exposed_ms']:8.3f} ms | {row['full_exposed_ms']:8.3f} ms | {opt} |"
    )


# (model, pp, tp, microbatches, schedule, levels); OPT's per-stage time limit is capped per model
SWEEP = [
    *[
        (model, pp, tp, m, "1f1b", (0.0, 0.1, 0.3, 0.6, 0.9))
        for model in ("gpt-tiny", "llama-tiny")
        for pp, tp, m in ((2, 1, 4), (2, 1, 8), (2, 2, 8), (4, 1, 8), (4, 1, 16))
    ],
    *[
        (model, 2, 1, 4, sched, (0.0, 0.3, 0.6))
        for model in ("gpt-tiny", "llama-tiny")
        for sched in ("gpipe", "interleaved1f1b")
    ],
    ("gpt-1.3b", 4, 1, 8, "1f1b", (0.0, 0.3)),
    ("gpt-1.3b", 8, 1, 8, "1f1b", (0.3,)),
    ("gpt-2.7b", 4, 2, 8, "1f1b", (0.3,)),
]
SWEEP_OPT_LIMIT = {"gpt-tiny": 10.0, "llama-tiny": 10.0, "gpt-1.3b": 10.0, "gpt-2.7b": 10.0}


def sweep(opt_limit: float, models: list[str] | None = None, offload: bool = False) -> tuple[list[dict], list[str]]:
    """Whole plans with HEU and OPT over :data:`SWEEP`, scored by the simulator; with ``offload``
    both decide offload too (``offload=True``, h100-sxm's PCIe 5.0 host link) on the points whose
    schedule offload plans (one chunk per device: not interleaved)."""
    from lynx.planner.offload_costs import OFFLOAD_SCHEDULES
    from lynx.frontend.analyze import analyze
    from lynx.planner.loop import plan_graph_outcome
    from lynx.config import CompileConfig
    from lynx.models import resolve_model
    from lynx.solvers.offload import total_exposed_s
    from lynx.solvers.problem import exposed_recompute_s

    exposed = total_exposed_s if offload else exposed_recompute_s   # (with offload: + copy waits)

    graphs: dict[str, object] = {}
    rows: list[dict] = []
    lines = [
        "",
        "## Sweep: whole plans (fixed point, simulator), HEU vs OPT" + (", both with offload" if offload else ""),
        "",
        "| point | budget level | HEU step ms | OPT step ms | HEU − OPT / OPT step | OPT status (stages) | "
        "worst stage: HEU − OPT exposed recompute ms (/ OPT step) | HEU s | OPT s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for model, pp, tp, m, sched, levels in SWEEP:
        if models and model not in models:
            continue
        if offload and sched not in OFFLOAD_SCHEDULES:
            continue
        if model not in graphs:
            r = resolve_model(model)
            graphs[model] = analyze(r.model, r.example_inputs, target="cuda", hardware="h100-sxm").graph
        graph = graphs[model]
        base = CompileConfig(
            pp=pp, tp=tp, microbatches=m, schedule=sched, hardware="h100-sxm", memory_budget=2**50, solver="none",
            offload=offload,
        )
        try:
            none = plan_graph_outcome(graph, base, check_budget=False, assemble=False)
        except LynxError as err:
            print(f"skip {model} pp{pp} tp{tp} m{m} {sched}: {err}", flush=True)
            continue
        full = plan_graph_outcome(
            graph, base.replace(solver="full"), check_budget=False, pipeline=none.pipeline, assemble=False
        )
        none_peak, full_peak = max(none.sim.peak_memory_bytes), max(full.sim.peak_memory_bytes)
        limit = min(opt_limit, SWEEP_OPT_LIMIT.get(model, opt_limit))
        for level in levels:
            budget = int(full_peak + level * (none_peak - full_peak))
            cfg = base.replace(memory_budget=budget)
            name = f"{model} pp{pp} tp{tp} m{m} {sched}"
            row: dict = {"point": name, "level": level, "budget": budget}
            try:
                heu = plan_graph_outcome(
                    graph, cfg.replace(solver="heu"), check_budget=False, pipeline=none.pipeline, assemble=False
                )
                opt = plan_graph_outcome(
                    graph,
                    cfg.replace(solver="opt", time_limit_s=limit),
                    check_budget=False,
                    pipeline=none.pipeline,
                    assemble=False,
                )
            except LynxError as err:
                row["error"] = str(err)[:200]
                rows.append(row)
                lines.append(f"| {name} | {level} | error: {row['error'][:80]} | | | | | | |")
                print(lines[-1], flush=True)
                continue
            statuses = [r.status for r in opt.results]
            # Per stage, on the same problems (the first round's): each solver's exposed recompute
            stage_gaps = []
            first = plan_graph_outcome(
                graph,
                cfg.replace(solver="heu", max_iterations=1),
                check_budget=False,
                pipeline=none.pipeline,
                assemble=False,
            )
            for problem, result in zip(first.problems, first.results):
                try:
                    o = solve("opt", problem, time_limit_s=limit)
                except LynxError:
                    continue
                heu_exposed = exposed(problem, result.assignment)
                opt_exposed = exposed(problem, o.assignment)
                excess = heu_exposed - opt_exposed
                stage_gaps.append(
                    {
                        "stage": problem.stage,
                        "opt_status": o.status,
                        "heu_exposed_ms": heu_exposed * 1e3,
                        "opt_exposed_ms": opt_exposed * 1e3,
                        "excess_ms": excess * 1e3,
                        "excess_of_step": excess / opt.sim.step_time_s,
                    }
                )
            worst = max(stage_gaps, key=lambda g: g["excess_of_step"], default=None)
            row.update(
                heu_step_s=heu.sim.step_time_s,
                opt_step_s=opt.sim.step_time_s,
                heu_fits=heu.sim.fits_budget,
                opt_fits=opt.sim.fits_budget,
                heu_vs_opt=heu.sim.step_time_s / opt.sim.step_time_s - 1,
                opt_statuses=statuses,
                opt_proved=all(st == "OPTIMAL" for st in statuses),
                heu_search_s=heu.search_time_s,
                opt_search_s=opt.search_time_s,
                stages=stage_gaps,
            )
            rows.append(row)
            status = "OPTIMAL" if row["opt_proved"] else ",".join(statuses)
            worst_txt = (
                f"s{worst['stage']} {worst['excess_ms']:+.4f} ({100 * worst['excess_of_step']:+.3f} %, "
                f"OPT {worst['opt_status']})"
                if worst
                else "-"
            )
            lines.append(
                f"| {name} | {level} | {row['heu_step_s'] * 1e3:.4f} | {row['opt_step_s'] * 1e3:.4f} | "
                f"{100 * row['heu_vs_opt']:+.3f} % | {status} | {worst_txt} | {row['heu_search_s']:.3f} | "
                f"{row['opt_search_s']:.2f} |"
            )
            print(lines[-1], flush=True)
    ok = [r for r in rows if "error" not in r]
    proved = [r for r in ok if r["opt_proved"]]
    stage_proved = [g for r in ok for g in r["stages"] if g["opt_status"] == "OPTIMAL"]
    worst_all = max(ok, key=lambda r: r["heu_vs_opt"], default=None)
    worst_proved = max(proved, key=lambda r: r["heu_vs_opt"], default=None)
    worst_stage = max(stage_proved, key=lambda g: g["excess_of_step"], default=None)
    summary = [
        "",
        f"- sweep: {len(ok)} points planned ({len(rows) - len(ok)} errors), OPT proved every stage optimal on "
        f"{len(proved)}",
        "- worst HEU step-time excess over OPT, all points: "
        + (
            f"{100 * worst_all['heu_vs_opt']:+.3f} % ({worst_all['point']}, level {worst_all['level']})"
            if worst_all
            else "-"
        )
        + "; where OPT proved optimal: "
        + (
            f"{100 * worst_proved['heu_vs_opt']:+.3f} % ({worst_proved['point']}, level {worst_proved['level']})"
            if worst_proved
            else "-"
        )
        + " (bar: ≤ +1 %)",
        "- worst per-stage HEU excess exposed recompute over a proven-optimal OPT stage: "
        + (
            f"{worst_stage['excess_ms']:+.4f} ms = {100 * worst_stage['excess_of_step']:+.3f} % of OPT's step time"
            if worst_stage
            else "-"
        )
        + f" ({len(stage_proved)} proven stages)",
    ]
    return rows, lines + summary


HEADER = (
    "| stage | nodes | windows | HEU time (wall / CPU) | HEU exposed | full exposed | OPT status | OPT time | "
    "OPT gap | OPT exposed | HEU − OPT / step |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--opt-time-limit", type=float, default=60.0)
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--sections", default="synthetic,real,sweep", help="which of synthetic,real,sweep to run")
    ap.add_argument("--sweep-models", default="", help="limit the sweep to these models (comma-separated)")
    ap.add_argument("--offload", action="store_true",
                    help="the sweep with offload=True (HEU with offload vs OPT with offload) → "
                         "solver_quality_offload.{md,json}")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if args.no_real:
        sections.discard("real")
    lines = [f"# OPT vs HEU (budget level {args.level} for the stage sections; `{' '.join(sys.argv)}`)"]
    rows: list[dict] = []
    if "synthetic" in sections:
        lines += ["", "## Synthetic stages (pp=4, stage 0)", "", HEADER]
        print("\n".join(lines), flush=True)
        cases = [
            (m, mb, tp)
            for m in MODELS
            for mb, tp in ((8, 1), (32, 1), (8, 2))
            if m in ("gpt-1.3b", "gpt-20b") or (mb, tp) == (8, 1)
        ]
        for model, mb, tp in cases:
            row = measure(synthetic(model, mb, tp, args.level), args.repeats, min(args.opt_time_limit, 20.0))
            row.update(kind="synthetic", model=model, tp=tp)
            rows.append(row)
            lines.append(fmt(row, f"{model} m={mb} tp={tp}"))
            print(lines[-1], flush=True)
    if "real" in sections:
        lines += ["", "## Real stages (captured + profiled, h100-sxm, pp=4, m=8, tp=1)", "", HEADER]
        print("\n".join(lines[-4:]), flush=True)
        for model, limit in (("gpt-1.3b", args.opt_time_limit), ("gpt-20b", min(args.opt_time_limit, 20.0))):
            for problem in real_problems(model, 8, args.level):
                row = measure(problem, args.repeats, limit)
                row.update(kind="real", model=model, stage=problem.stage)
                rows.append(row)
                lines.append(fmt(row, f"{model} stage {problem.stage}"))
                print(lines[-1], flush=True)
    summary = []
    stage_rows = [r for r in rows if r.get("kind") in ("synthetic", "real")]
    heu_20b = [r["heu_s"] for r in stage_rows if r["model"] == "gpt-20b"]
    cpu_20b = [r["heu_cpu_s"] for r in stage_rows if r["model"] == "gpt-20b"]
    excess = [r["heu_excess_of_step"] for r in stage_rows if "heu_excess_of_step" in r]
    proven = [r for r in stage_rows if r["model"] == "gpt-1.3b" and "opt_s" in r]
    if heu_20b:
        summary.append(
            f"- HEU search time on gpt-20b stages: median {1e3 * statistics.median(heu_20b):.1f} ms, "
            f"max {1e3 * max(heu_20b):.1f} ms; CPU time median {1e3 * statistics.median(cpu_20b):.1f} ms, "
            f"max {1e3 * max(cpu_20b):.1f} ms (per stage, cold; the whole-plan bar is in search.md)"
        )
    if excess:
        summary.append(
            f"- HEU − OPT exposed recompute as a share of the step proxy: median "
            f"{100 * statistics.median(excess):.3f} %, max {100 * max(excess):.3f} % (bar: ≤ 1 %)"
        )
    if proven:
        summary.append(
            f"- OPT proved optimality (relative gap ≤ 1e-4) on {sum(r['opt_status'] == 'OPTIMAL' for r in proven)} of "
            f"{len(proven)} gpt-1.3b stages; largest gap when stopped: "
            f"{max((r['opt_gap'] or 0 for r in proven), default=0):.4f}"
        )
    lines += summary
    if "sweep" in sections:
        sweep_rows, sweep_lines = sweep(args.opt_time_limit, [m for m in args.sweep_models.split(",") if m],
                                        offload=args.offload)
        for r in sweep_rows:
            r["kind"] = "sweep"
        rows += sweep_rows
        lines += sweep_lines
        print("\n".join(sweep_lines[-3:]))
    lines.append(
        f"\nLoad average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores"
    )
    print("\n".join(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "solver_quality_offload" if args.offload else "solver_quality"
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
