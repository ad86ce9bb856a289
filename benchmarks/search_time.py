"""OPT vs HEU search time (and plan quality) over gpt-1.3b … gpt-20b, llama-7b and a transformers Llama.

The models: the GPT presets, the ``llama-7b`` preset (RMSNorm, RoPE, SwiGLU) and
``hf-llama-7b``, transformers' LlamaForCausalLM built from Llama 2 7B's config (bf16, sdpa;
``benchmarks/hf_llama.py``). Each model is captured and profiled once (meta device, h100-sxm, 1F1B, pp 4, tp 1,
8 microbatches); the budget is 30% of the way from `full`'s peak to `none`'s. Both solvers
get the same stage problems (the windows of the first timeline); search time is the solver
time of that one round over all stages — HEU's the median of ``--repeats`` cold runs (HEU's
structure cache cleared before each), OPT's one run with ``--opt-time-limit`` per stage
(status and gap reported). HEU's *whole plan* is also timed: ``lynx.compile``'s planning loop
(fixed point, up to 3 rounds; the plan's ``search_time_s``), median of ``--repeats`` cold
plans, wall and CPU time. Both one-round plans are scored by the simulator: the bar is HEU
within 1% of OPT's step time, HEU planning gpt-20b ≤ 0.05 s median, OPT OPTIMAL on gpt-1.3b
within 60 s. The load average is recorded with the figures (the machine is shared).

    .venv/bin/python benchmarks/search_time.py
    .venv/bin/python benchmarks/search_time.py --models gpt-1.3b --repeats 3
    .venv/bin/python benchmarks/search_time.py --reuse-opt     # HEU only; OPT columns from search.json
    lynx bench search                                     # the same
    .venv/bin/python benchmarks/search_time.py --opt-grid gpt-1.3b   # OPT on every grid stage
    .venv/bin/python benchmarks/search_time.py --plans-only          # only the section below

Then HEU's whole plans at issue 17's points, cold (a fresh process per measurement) and warm,
and ``lynx plan``'s wall time (``benchmarks/search_plan.py``; ``--no-plans`` skips them).

Writes benchmarks/results/search.{md,json,png} and search_plan.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lynx.planner.loop import plan_graph_outcome  # noqa: E402
from lynx.config import CompileConfig  # noqa: E402
from lynx.planner.problems import build_problems  # noqa: E402
from lynx.planner.simulator import simulate_assignments  # noqa: E402
from lynx.planner.timeline import run_timeline  # noqa: E402

MODELS = ["gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-20b", "llama-7b", "hf-llama-7b"]
# beyond the presets: transformers' LlamaForCausalLM with Llama 2 7B's config (benchmarks/hf_llama.py)
SPECS = {"hf-llama-7b": f"{ROOT / 'benchmarks' / 'hf_llama.py'}:llama_7b"}


def solve_round(solver: str, problems: list[Any], time_limit_s: float) -> tuple[float, float, list[Any]]:
    """Solver wall and CPU seconds of one planning round over every stage, and the results."""
    from lynx.solvers import solve
    from lynx.solvers.heu.solve import clear_cache

    clear_cache()  # cold: HEU caches a stage's structure and results for the planner's fixed point
    started, started_cpu = time.perf_counter(), time.process_time()
    results = [solve(solver, p, time_limit_s=time_limit_s) for p in problems]
    return time.perf_counter() - started, time.process_time() - started_cpu, results


def level_budget(graph: Any, level: float) -> tuple[CompileConfig, Any, Any, int]:
    """The section's setting (pp 4, 1F1B, 8 microbatches, h100-sxm; solver none), the outcomes of
    plans ``none`` and ``full``, and the budget ``level`` of the way from ``full``'s peak to ``none``'s."""
    base = CompileConfig(pp=4, microbatches=8, hardware="h100-sxm", memory_budget=2**50, solver="none")
    none = plan_graph_outcome(graph, base, check_budget=False, assemble=False)
    full = plan_graph_outcome(graph, base.replace(solver="full"), check_budget=False, pipeline=none.pipeline,
                              assemble=False)
    none_peak, full_peak = max(none.sim.peak_memory_bytes), max(full.sim.peak_memory_bytes)
    return base, none, full, int(full_peak + level * (none_peak - full_peak))


def whole_plan(graph: Any, config: CompileConfig, pipe: Any) -> tuple[float, float, int]:
    """HEU's solver time over a whole plan (the planning loop's every round): wall, CPU, rounds."""
    out, cpu_s = cold_outcome(graph, config, pipe)
    return out.search_time_s, cpu_s, out.iterations


def cold_outcome(graph: Any, config: CompileConfig, pipe: Any) -> tuple[Any, float]:
    """One whole plan with HEU's structure cache cleared first: the planning loop's outcome
    (unassembled) and the solver's CPU seconds over every round."""
    from lynx.solvers import solve
    from lynx.solvers.heu.solve import clear_cache

    cpu = [0.0]

    def timed(name: str, problem: Any, **kw: Any) -> Any:
        started = time.process_time()
        try:
            return solve(name, problem, **kw)
        finally:
            cpu[0] += time.process_time() - started

    clear_cache()
    return plan_graph_outcome(graph, config, solve=timed, pipeline=pipe, assemble=False), cpu[0]


def bench_model(name: str, repeats: int, opt_time_limit: float, level: float = 0.3,
                reuse: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One planning round (the first timeline's windows) with HEU and with OPT, same problems;
    both scored by the simulator; and HEU's whole plan. ``reuse``: OPT's figures from an
    earlier run instead of solving with OPT."""
    from lynx.frontend.analyze import analyze
    from lynx.models import resolve_model

    resolved = resolve_model(SPECS.get(name, name))
    t0 = time.perf_counter()
    graph = analyze(resolved.model, resolved.example_inputs, target="cuda", hardware="h100-sxm").graph
    analyse_s = time.perf_counter() - t0
    base, none, full, budget = level_budget(graph, level)
    pipe, static = none.pipeline, none.sim.static_bytes
    problems = build_problems(graph, pipe, run_timeline(pipe, record=False), budget_bytes=budget, static=static)
    heu_times, heu_cpu = [], []
    for _ in range(repeats):
        seconds, cpu_s, heu_results = solve_round("heu", problems, 10.0)
        heu_times.append(seconds)
        heu_cpu.append(cpu_s)
    plans = [whole_plan(graph, base.replace(solver="heu", memory_budget=budget), pipe) for _ in range(repeats)]

    def score(results: list[Any]) -> Any:
        return simulate_assignments(graph, pipe, problems, [r.assignment for r in results], static=static,
                                    budget_bytes=budget, record=False)

    heu_sim = score(heu_results)
    row = {
        "model": name, "analyse_s": analyse_s, "budget": budget, "nodes_per_stage": [len(p.nodes) for p in problems],
        "windows_per_stage": [len(p.windows) for p in problems],
        "heu_round_median_s": statistics.median(heu_times), "heu_rounds_s": heu_times,
        "heu_round_cpu_median_s": statistics.median(heu_cpu),
        "heu_per_stage_s": [r.search_time_s for r in heu_results],
        "heu_plan_median_s": statistics.median(p[0] for p in plans), "heu_plans_s": [p[0] for p in plans],
        "heu_plan_cpu_median_s": statistics.median(p[1] for p in plans), "heu_plan_rounds": plans[0][2],
        "heu_step_s": heu_sim.step_time_s, "heu_fits": heu_sim.fits_budget,
        "full_step_s": full.sim.step_time_s, "none_step_s": none.sim.step_time_s,
        "load_average": os.getloadavg(),
    }
    if reuse is not None:
        row.update({k: v for k, v in reuse.items() if k.startswith("opt_")}, opt_reused=True)
    else:
        opt_s, _, opt_results = solve_round("opt", problems, opt_time_limit)
        opt_sim = score(opt_results)
        statuses = [r.status for r in opt_results]
        gaps = [r.gap for r in opt_results if r.gap is not None]
        row.update({
            "opt_search_s": opt_s, "opt_per_stage_s": [r.search_time_s for r in opt_results],
            "opt_status": "OPTIMAL" if all(st == "OPTIMAL" for st in statuses) else ",".join(statuses),
            "opt_gap": max(gaps) if gaps else None, "opt_step_s": opt_sim.step_time_s, "opt_fits": opt_sim.fits_budget,
        })
    row["heu_vs_opt"] = row["heu_step_s"] / row["opt_step_s"] - 1
    print(f"{name}: HEU {row['heu_round_median_s'] * 1e3:.1f} ms per cold round of {len(problems)} stages "
          f"(CPU {row['heu_round_cpu_median_s'] * 1e3:.1f} ms), whole plan {row['heu_plan_median_s'] * 1e3:.1f} ms "
          f"(CPU {row['heu_plan_cpu_median_s'] * 1e3:.1f} ms, {row['heu_plan_rounds']} rounds), "
          f"OPT {row['opt_search_s']:.2f} s {row['opt_status']} gap={row['opt_gap']}"
          f"{' (reused)' if reuse is not None else ''}, HEU vs OPT step {row['heu_vs_opt']:+.3%}, "
          f"load {row['load_average'][0]:.1f}", flush=True)
    return row


def write_outputs(rows: list[dict[str, Any]], out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# OPT vs HEU search time (pp 4, tp 1, 8 microbatches, h100-sxm, budget 30% from full to none)", "",
             "| model | nodes/stage | windows/stage | HEU s, one round (median, cold; CPU) | HEU s per stage | "
             "HEU s, whole plan (median; CPU; rounds) | OPT s (one round) | OPT status | "
             "OPT gap | HEU step ms | OPT step ms | HEU vs OPT | full step ms | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "-" if r["opt_gap"] is None else f"{r['opt_gap']:.2%}"
        reused = " (earlier run)" if r.get("opt_reused") else ""
        lines.append(f"| {r['model']} | {max(r['nodes_per_stage'])} | {max(r['windows_per_stage'])} | "
                     f"{r['heu_round_median_s']:.4f}; {r['heu_round_cpu_median_s']:.4f} | "
                     f"{', '.join(f'{t:.4f}' for t in r['heu_per_stage_s'])} | "
                     f"{r['heu_plan_median_s']:.4f}; {r['heu_plan_cpu_median_s']:.4f}; {r['heu_plan_rounds']} | "
                     f"{r['opt_search_s']:.2f}{reused} | "
                     f"{r['opt_status']} | {gap} | {r['heu_step_s'] * 1e3:.2f} | {r['opt_step_s'] * 1e3:.2f} | "
                     f"{r['heu_vs_opt']:+.3%} | {r['full_step_s'] * 1e3:.2f} | {r['load_average'][0]:.1f} |")
    summary = []
    by = {r["model"]: r for r in rows}
    if "gpt-20b" in by:
        r = by["gpt-20b"]
        summary.append(f"HEU gpt-20b: whole plan {r['heu_plan_median_s']:.4f} s median wall, "
                       f"{r['heu_plan_cpu_median_s']:.4f} s CPU ({r['heu_plan_rounds']} rounds); one cold round "
                       f"{r['heu_round_median_s']:.4f} s wall, {r['heu_round_cpu_median_s']:.4f} s CPU (bar ≤ 0.05 s; "
                       f"load average {r['load_average'][0]:.1f} on {os.cpu_count()} cores)")
    summary.append(f"HEU vs OPT worst step-time gap {max(r['heu_vs_opt'] for r in rows):+.3%} (bar ≤ +1%)")
    if "gpt-1.3b" in by:
        summary.append(f"OPT gpt-1.3b: {by['gpt-1.3b']['opt_status']} in {by['gpt-1.3b']['opt_search_s']:.2f} s")
    lines += ["", *summary]
    (out / "search.md").write_text("\n".join(lines) + "\n")
    (out / "search.json").write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["opt_search_s"] for r in rows], 0.4, label="OPT (CP-SAT)")
    ax.bar([x + 0.2 for x in xs], [r["heu_round_median_s"] for r in rows], 0.4, label="HEU")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["model"] for r in rows])
    ax.set_ylabel("search time (s, log)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "search.png", dpi=120)
    plt.close(fig)
    return summary


def opt_grid(model: str = "gpt-1.3b", time_limit_s: float = 60.0, out: Path = ROOT / "benchmarks" / "results",
             levels: tuple[float, ...] = (1.0, 0.3, 0.0)) -> list[dict[str, Any]]:
    """OPT on every stage of ``model``'s grid configurations (benchmarks/grid.py: a100-80g and
    h100-sxm, pp 4 and 8, tp 1/2/4, 8 microbatches, budgets at ``levels``): the stage problems
    of the first planning round, ``time_limit_s`` per stage, 1 worker; status, gap and time
    per stage. Writes search_time_opt_<model>.{md,json}."""
    from grid import profiled_graphs, retimed

    from lynx.errors import LynxError

    graph = profiled_graphs([model])[model]
    rows = []
    for hw in ("a100-80g", "h100-sxm"):
        g = retimed(graph, hw)
        for pp in (4, 8):
            for tp in (1, 2, 4):
                base = CompileConfig(pp=pp, tp=tp, microbatches=8, hardware=hw, memory_budget=2**50, solver="none")
                none = plan_graph_outcome(g, base, check_budget=False, assemble=False)
                full = plan_graph_outcome(g, base.replace(solver="full"), check_budget=False,
                                          pipeline=none.pipeline, assemble=False)
                none_peak, full_peak = max(none.sim.peak_memory_bytes), max(full.sim.peak_memory_bytes)
                pipe, static = none.pipeline, none.sim.static_bytes
                for level in levels:
                    budget = int(full_peak + level * (none_peak - full_peak))
                    problems = build_problems(g, pipe, run_timeline(pipe, record=False), budget_bytes=budget,
                                              static=static, tp=tp)
                    from lynx.solvers import solve

                    for p in problems:
                        started = time.perf_counter()
                        try:
                            r = solve("opt", p, time_limit_s=time_limit_s)
                            status, gap = r.status, r.gap
                        except LynxError as err:
                            status, gap = f"error: {str(err)[:80]}", None
                        row = {"point": f"{model} {hw} pp{pp} tp{tp} L{level}", "stage": p.stage,
                               "nodes": len(p.nodes), "windows": len(p.windows), "status": status, "gap": gap,
                               "seconds": time.perf_counter() - started, "load": os.getloadavg()[0]}
                        rows.append(row)
                        print(f"{row['point']} stage {p.stage}: {status} gap={gap} in {row['seconds']:.1f} s "
                              f"(load {row['load']:.1f})", flush=True)
    proven = [r for r in rows if r["status"] == "OPTIMAL" and r["seconds"] <= time_limit_s]
    others = [r for r in rows if r not in proven]
    lines = [f"# OPT on every stage of {model}'s grid configurations ({time_limit_s:.0f} s per stage, 1 worker)", "",
             f"Command: `.venv/bin/python benchmarks/search_time.py --opt-grid {model}`", "",
             f"{len(proven)} of {len(rows)} stage problems proven OPTIMAL within {time_limit_s:.0f} s "
             f"(slowest {max((r['seconds'] for r in proven), default=0):.1f} s); not proven: {len(others)}"
             + "".join(f"; {r['point']} stage {r['stage']} {r['status']} gap {r['gap']}" for r in others), "",
             "| point | stage | nodes | windows | status | gap | s | load |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "-" if r["gap"] is None else f"{r['gap']:.2%}"
        lines.append(f"| {r['point']} | {r['stage']} | {r['nodes']} | {r['windows']} | {r['status']} | {gap} | "
                     f"{r['seconds']:.1f} | {r['load']:.1f} |")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"search_time_opt_{model}.md").write_text("\n".join(lines) + "\n")
    (Path(out) / f"search_time_opt_{model}.json").write_text(json.dumps(rows, indent=1))
    print(lines[4])
    return rows


def main(models: Optional[list[str]] = None, repeats: int = 5, opt_time_limit: float = 60.0,
         out: Path = ROOT / "benchmarks" / "results", reuse_opt: bool = False, plans: bool = True,
         rounds: bool = True) -> int:
    if plans:  # whole plans, cold and warm, and lynx plan (benchmarks/search_plan.py)
        import search_plan

        search_plan.main(repeats=repeats, out=Path(out))
    if not rounds:
        return 0
    earlier: dict[str, Any] = {}
    if reuse_opt:
        earlier = {r["model"]: r for r in json.loads((Path(out) / "search.json").read_text())}
    rows = [bench_model(name, repeats, opt_time_limit, reuse=earlier.get(name) if reuse_opt else None)
            for name in (models or MODELS)]
    for row in rows:
        row["when_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # --models re-runs some rows: the others stay as the last run left them (not dropped)
    previous = Path(out) / "search.json"
    if previous.exists():
        fresh = {r["model"] for r in rows}
        kept = [r for r in json.loads(previous.read_text()) if r["model"] not in fresh]
        order = {m: i for i, m in enumerate(MODELS)}
        rows = sorted(kept + rows, key=lambda r: order.get(r["model"], len(order)))
    summary = write_outputs(rows, Path(out))
    print("\n".join(summary))
    print(f"wrote {Path(out) / 'search.md'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--opt-time-limit", type=float, default=60.0)
    parser.add_argument("--reuse-opt", action="store_true",
                        help="take OPT's figures from the existing search.json instead of re-solving (HEU only)")
    parser.add_argument("--no-plans", action="store_true", help="skip the whole-plan section (search_plan.py)")
    parser.add_argument("--plans-only", action="store_true", help="only the whole-plan section (search_plan.py)")
    parser.add_argument("--opt-grid", default=None, metavar="MODEL",
                        help="instead: OPT on every stage of MODEL's grid configurations → search_time_opt_MODEL.md")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = parser.parse_args()
    if a.opt_grid:
        opt_grid(a.opt_grid, a.opt_time_limit, a.out)
        raise SystemExit(0)
    raise SystemExit(main(a.models.split(","), a.repeats, a.opt_time_limit, a.out, a.reuse_opt,
                          plans=not a.no_plans, rounds=not a.plans_only))
