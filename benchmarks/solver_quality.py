"""OPT vs HEU: search time and plan quality on gpt-1.3b … gpt-20b sized pipeline stages.

Two sets of stage problems, each at a budget 30% of the way from Megatron-full's peak to
keep-all's peak (``--level``):

* synthetic: :func:`lynx.solvers.problem.make_uniform_problem` stages of pp=4 stage 0 (the
  stage holding 4 microbatches) with the models' hidden size, heads and layers per stage;
  windows: the warm-up wait before microbatch 0 (≈ 3 stages × (F + B)), a short cool-down
  wait for the last 3 microbatches, and with tp=2 a tensor-parallel all-reduce window per
  layer of every backward;
* real: the StageProblems the planner builds (``lynx.compile.plan_graph_outcome``) from the
  captured and profiled model (meta device, h100-sxm, pp=4, 1F1B, tp=1).

For each: HEU's search time (median of ``--repeats`` runs), OPT's status, time and gap, both
plans' exposed recompute, and HEU's excess over OPT relative to a 1F1B step-time proxy
``(m + p − 1) · 3 · F`` (F = the stage's forward time; the planner's grid benchmark checks
the same with its simulator).

    .venv/bin/python benchmarks/solver_quality.py                  # ~10 min on 2 cores
    .venv/bin/python benchmarks/solver_quality.py --no-real --opt-time-limit 10

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
from lynx.solvers.problem import Assignment, StageProblem, make_uniform_problem, peak_activation_bytes  # noqa: E402

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
    base = make_uniform_problem(layers=per_stage, hidden=hidden // tp, heads=heads // tp, seq=2048,
                                microbatches=microbatches, in_flight=min(PP, microbatches), views=True)
    forward = sum(n.recompute_s for n in base.nodes)
    caps = [3 * 3 * forward] + [0.0] * (microbatches - 4) + [forward / 4] * 3
    problem = make_uniform_problem(
        layers=per_stage, hidden=hidden // tp, heads=heads // tp, seq=2048, microbatches=microbatches,
        in_flight=min(PP, microbatches), views=True, recv_grad_capacity_s=caps,
        tp_capacity_s=0.05 * forward / per_stage if tp > 1 else 0.0)
    return at_level(problem, level)


def real_problems(model: str, microbatches: int, level: float) -> list[StageProblem]:
    from lynx.analyze import analyze
    from lynx.compile import plan_graph_outcome
    from lynx.config import CompileConfig
    from lynx.models import resolve_model

    started = time.perf_counter()
    resolved = resolve_model(model)
    graph = analyze(resolved.model, resolved.example_inputs, target="cuda", hardware="h100-sxm").graph
    cfg = CompileConfig(pp=PP, microbatches=microbatches, tp=1, hardware="h100-sxm", solver="full",
                        memory_budget="1000GiB")
    problems = plan_graph_outcome(graph, cfg, check_budget=False, assemble=False).problems
    print(f"  {model}: analysed and built {len(problems)} stage problems in {time.perf_counter() - started:.1f} s",
          flush=True)
    return [at_level(p, level) for p in problems]


def measure(problem: StageProblem, repeats: int, opt_limit: float | None) -> dict:
    times, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        heu = solve("heu", problem)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    forward = sum(n.recompute_s for n in problem.nodes)
    step = (problem.microbatches + PP - 1) * 3 * forward
    row = {"nodes": len(problem.nodes), "windows": len(problem.windows), "m": problem.microbatches,
           "heu_s": statistics.median(times), "heu_cpu_s": statistics.median(cpu), "heu_exposed_ms": heu.objective_s * 1e3,
           "full_exposed_ms": solve("full", problem).objective_s * 1e3, "step_proxy_ms": step * 1e3}
    if opt_limit:
        try:
            opt = solve("opt", problem, time_limit_s=opt_limit)
            row.update(opt_status=opt.status, opt_s=opt.search_time_s, opt_gap=opt.gap,
                       opt_exposed_ms=opt.objective_s * 1e3,
                       heu_excess_of_step=(heu.objective_s - opt.objective_s) / step)
        except LynxError as err:
            row.update(opt_status=f"error: {err}")
    return row


def fmt(row: dict, label: str) -> str:
    opt = (f"{row['opt_status']:8s} {row['opt_s']:7.2f} s gap {row['opt_gap']:.4f} | "
           f"{row['opt_exposed_ms']:8.3f} ms | {100 * row['heu_excess_of_step']:6.3f} %"
           if "opt_s" in row else f"{row.get('opt_status', '-'):8s}")
    return (f"| {label} | {row['nodes']} | {row['windows']} | {1e3 * row['heu_s']:6.1f} / {1e3 * row['heu_cpu_s']:5.1f} ms | "
            f"{row['heu_exposed_ms']:8.3f} ms | {row['full_exposed_ms']:8.3f} ms | {opt} |")


HEADER = ("| stage | nodes | windows | HEU time (wall / CPU) | HEU exposed | full exposed | OPT status | OPT time | "
          "OPT gap | OPT exposed | HEU − OPT / step |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--opt-time-limit", type=float, default=60.0)
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    lines = [f"# OPT vs HEU (budget level {args.level}; `{' '.join(sys.argv)}`)", "", "## Synthetic stages (pp=4, stage 0)", "",
             HEADER]
    print("\n".join(lines), flush=True)
    rows: list[dict] = []
    cases = [(m, mb, tp) for m in MODELS for mb, tp in ((8, 1), (32, 1), (8, 2))
             if m in ("gpt-1.3b", "gpt-20b") or (mb, tp) == (8, 1)]
    for model, mb, tp in cases:
        row = measure(synthetic(model, mb, tp, args.level), args.repeats, min(args.opt_time_limit, 20.0))
        row.update(kind="synthetic", model=model, tp=tp)
        rows.append(row)
        lines.append(fmt(row, f"{model} m={mb} tp={tp}"))
        print(lines[-1], flush=True)
    if not args.no_real:
        lines += ["", "## Real stages (captured + profiled, h100-sxm, pp=4, m=8, tp=1)", "", HEADER]
        print("\n".join(lines[-4:]), flush=True)
        for model, limit in (("gpt-1.3b", args.opt_time_limit), ("gpt-20b", min(args.opt_time_limit, 20.0))):
            for problem in real_problems(model, 8, args.level):
                row = measure(problem, args.repeats, limit)
                row.update(kind="real", model=model, stage=problem.stage)
                rows.append(row)
                lines.append(fmt(row, f"{model} stage {problem.stage}"))
                print(lines[-1], flush=True)
    heu_20b = [r["heu_s"] for r in rows if r["model"] == "gpt-20b"]
    cpu_20b = [r["heu_cpu_s"] for r in rows if r["model"] == "gpt-20b"]
    excess = [r["heu_excess_of_step"] for r in rows if "heu_excess_of_step" in r]
    proven = [r for r in rows if r["model"] == "gpt-1.3b" and "opt_s" in r]
    summary = [
        "",
        f"- HEU search time on gpt-20b stages: median {1e3 * statistics.median(heu_20b):.1f} ms, "
        f"max {1e3 * max(heu_20b):.1f} ms; CPU time median {1e3 * statistics.median(cpu_20b):.1f} ms, "
        f"max {1e3 * max(cpu_20b):.1f} ms (bar: ≤ 50 ms median; load average during the run: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores)",
        f"- HEU − OPT exposed recompute as a share of the step proxy: median {100 * statistics.median(excess):.3f} %, "
        f"max {100 * max(excess):.3f} % (bar: ≤ 1 %)",
        f"- OPT proved optimality (relative gap ≤ 1e-4) on {sum(r['opt_status'] == 'OPTIMAL' for r in proven)} of "
        f"{len(proven)} gpt-1.3b stages; largest gap when stopped: "
        f"{max((r['opt_gap'] for r in proven), default=0):.4f}",
    ]
    lines += summary
    print("\n".join(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "solver_quality.md").write_text("\n".join(lines) + "\n")
    (args.out / "solver_quality.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
