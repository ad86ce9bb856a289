"""How close can offload bring level 0.0 to the no-recompute step? A lower bound from the hardware model.

At the grid's tightest budget (level 0.0: `full`'s peak) HEU with offload is a median 1.097×
the no-recompute step (``benchmarks/results/grid_offload_full.md``; bar 1.05×). This asks
whether the simulator's hardware model allows better, on a representative subset of the grid
(both presets, gpt-1.3b … gpt-20b, pp 4 / 8, tp 1 / 2 / 4, 8 / 32 microbatches). Per stage,
from the stage problems the planner builds for HEU with offload (its last round):

* ``D``: the bytes each microbatch must take off the device. Every microbatch takes the same
  decisions and ``in_flight`` of them hold their kept bytes at once, so kept bytes ≤
  budget / in_flight (the solvers' memory model, of which the real peak is at least that
  term), and ``D = saved − budget / in_flight`` (values the stage sends on stay anyway);
* each value (in shares: a linear program, GLOP) is streamed back during the microbatch's own
  backward, prefetched before it, recomputed in a window before it (recv), in a window inside
  it (tensor-parallel), or on demand; recomputing it re-runs (at least as large a share of)
  each input whose output nothing saves. What is back before the backward starts (a prefetch, a
  recv window's recomputation) is held at the peak beside the ``in_flight`` kept sets, so it
  frees only ``1 − 1/in_flight`` of its bytes; the host→device lane (a shared host link's
  share per device) streams at most ``rate · B`` during the backward and prefetches at most
  ``rate · F`` during the forward the 1F1B period also runs (the device→host lane has the
  microbatch's whole stay); windows take at most their summed capacity (``m`` microbatches'
  recomputation; a window inside the backward only the layers it is eligible for); on-demand
  recomputation is exposed and lengthens the step one for one.

``bound = T0 + max over stages of the least exposed seconds``, ``T0`` the no-recompute step
(`none`'s, fitting or not, as the grid's ratio). It relaxes the planner's other constraints
(issue times per group, pending copies' memory, per-copy latency, the memory that values
regenerated or streamed during a backward hold, each window's own capacity, whole-value
decisions, stages adding up along the critical path), so no plan under the simulator's
hardware model should beat it; where OPT with offload is run (``--opt``) the
summary checks that it does not.

    .venv/bin/python benchmarks/offload_bound.py            # 11 points, ~6 min on 2 busy cores
    .venv/bin/python benchmarks/offload_bound.py --opt      # + OPT with offload on the gpt-1.3b points
    .venv/bin/python benchmarks/offload_bound.py --opt --opt-models gpt-1.3b,gpt-2.7b   # ~20 min
    .venv/bin/python benchmarks/offload_bound.py --points "gpt-1.3b h100-sxm 4 1 8"

Writes benchmarks/results/offload_bound.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lynx.config import CompileConfig  # noqa: E402
from lynx.errors import LynxError  # noqa: E402
from lynx.planner.loop import plan_graph_outcome  # noqa: E402
from lynx.solvers.problem import StageProblem, is_sent  # noqa: E402

# (model, hardware, pp, tp, microbatches): the grid's best, median and worst level-0.0 points
POINTS = (
    ("gpt-1.3b", "a100-80g", 4, 1, 8),
    ("gpt-1.3b", "h100-sxm", 4, 1, 8),
    ("gpt-1.3b", "a100-80g", 8, 4, 8),
    ("gpt-2.7b", "a100-80g", 4, 1, 32),
    ("gpt-2.7b", "h100-sxm", 4, 4, 8),
    ("gpt-6.7b", "h100-sxm", 4, 1, 32),
    ("gpt-13b", "h100-sxm", 4, 2, 32),
    ("gpt-13b", "h100-sxm", 8, 4, 32),
    ("gpt-20b", "h100-sxm", 8, 4, 8),
    ("gpt-20b", "a100-80g", 8, 2, 32),
    ("gpt-20b", "h100-sxm", 8, 1, 32),
)
OPT_MODELS = "gpt-1.3b"   # --opt: OPT with offload where it finishes in minutes (--opt-models)


# windows that run before the backward of the microbatch they serve: what they recompute is
# held at its peak (tensor-parallel windows run inside the backward; dp ones counted as they)
BEFORE_BACKWARD = ("recv_grad", "recv_act")


def stage_bound(problem: StageProblem, none_step_s: float, forward_s: float, backward_s: float) -> dict[str, Any]:
    """The stage's least exposed seconds (see the module docstring: a linear program over the
    stage's droppable values) and its terms; ``forward_s`` / ``backward_s``: one microbatch's
    forward and backward on the stage."""
    from ortools.linear_solver import pywraplp

    copies = problem.copies
    assert copies is not None, "plan with offload=True"
    m, k = problem.microbatches, problem.in_flight
    saved = sum(n.saved_bytes for n in problem.nodes)
    must = max(0.0, saved - problem.activation_budget_bytes / k)   # D, bytes per microbatch
    rate = min(copies.d2h_bytes_per_s, copies.h2d_bytes_per_s)
    before = sum(w.capacity_s for w in problem.windows if w.kind in BEFORE_BACKWARD)
    inside = sum(w.capacity_s for w in problem.windows if w.kind not in BEFORE_BACKWARD)
    held = 1 - 1 / k   # what a value back before the backward frees at its start
    nodes = [n for n in problem.nodes if not is_sent(n)]   # (what the stage sends on stays: available)
    # a window serves its eligible layers only (edge blocks: windows serving every layer)
    served = [any(w.kind not in BEFORE_BACKWARD and (w.eligible_layers is None or n.layer is not None
                                                       and n.layer in w.eligible_layers) for w in problem.windows)
              for n in nodes]
    lp = pywraplp.Solver.CreateSolver("GLOP")
    # per value, the share streamed back during the backward, prefetched before it, recomputed in
    # a window before it, in a window inside it, on demand
    share = [[lp.NumVar(0, 1, "") for _ in range(5)] for _ in nodes]
    for parts, ok in zip(share, served):
        lp.Add(sum(parts) <= 1)
        if not ok:
            lp.Add(parts[3] == 0)
    # recomputing a value re-runs each input whose output nothing saves (a view, a matmul whose
    # consumer saves something else): at least the same share of it is recomputed too
    index = {n.name: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for u in n.inputs:
            j = index.get(u)
            if j is not None and not nodes[j].output_saved:
                lp.Add(sum(share[j][2:]) >= sum(share[i][2:]))
    mb = 2.0**20   # (bytes in MiB, seconds in ms: a well-scaled program)
    size = [n.saved_bytes / mb for n in nodes]
    cost = [n.recompute_s * 1e3 for n in nodes]
    lp.Add(sum(b * (s + d + t + held * (p + w)) for b, (s, p, w, t, d) in zip(size, share)) >= must / mb)
    lp.Add(sum(b * parts[0] for b, parts in zip(size, share)) <= rate * backward_s / mb)
    lp.Add(sum(b * parts[1] for b, parts in zip(size, share)) <= rate * forward_s / mb)
    lp.Add(m * sum(c * parts[2] for c, parts in zip(cost, share)) <= before * 1e3)
    lp.Add(m * sum(c * parts[3] for c, parts in zip(cost, share)) <= inside * 1e3)
    lp.Minimize(m * sum(c * parts[4] for c, parts in zip(cost, share)))
    status = lp.Solve()
    if status != pywraplp.Solver.OPTIMAL:   # (more must leave than the stage saves: no plan fits)
        return {"stage": problem.stage, "in_flight": k, "must_mb": must / mb, "infeasible": True,
                "bound_s": float("inf")}
    total = lambda col: sum(b * parts[col].solution_value() for b, parts in zip(size, share))  # noqa: E731
    exposed = lp.Objective().Value() / 1e3
    return {"stage": problem.stage, "in_flight": k, "saved_mb": saved / mb,
            "budget_mb": problem.activation_budget_bytes / mb,
            "must_mb": must / mb, "lane_gb_s": rate / 1e9, "lane_mb": rate * (backward_s + held * forward_s) / mb,
            "windows_before_ms": before * 1e3, "windows_inside_ms": inside * 1e3,
            "streamed_mb": total(0), "prefetched_mb": total(1), "window_before_mb": total(2),
            "window_inside_mb": total(3), "on_demand_mb": total(4), "exposed_ms": exposed * 1e3,
            "bound_s": none_step_s + exposed}


def bench_point(graph: Any, model: str, hw: str, pp: int, tp: int, m: int, with_opt: tuple[str, ...]
                ) -> dict[str, Any]:
    base = CompileConfig(pp=pp, tp=tp, microbatches=m, schedule="1f1b", hardware=hw, optimizer="adamw",
                         solver="none", memory_budget=2**50, max_iterations=4)
    none = plan_graph_outcome(graph, base, check_budget=False, assemble=False)
    full = plan_graph_outcome(graph, base.replace(solver="full"), check_budget=False, pipeline=none.pipeline,
                              assemble=False)
    budget = max(full.sim.peak_memory_bytes)   # level 0.0
    t0 = none.sim.step_time_s
    row: dict[str, Any] = {"point": f"{model} {hw} pp{pp} tp{tp} m{m}", "budget": budget, "none_step_s": t0}
    cfg = base.replace(memory_budget=budget)
    runs = [("heu", {"solver": "heu"}), ("heu+offload", {"solver": "heu", "offload": True})]
    if model in with_opt:
        runs.append(("opt+offload", {"solver": "opt", "offload": True, "time_limit_s": 10.0}))
    for label, settings in runs:
        started = time.perf_counter()
        try:
            out = plan_graph_outcome(graph, cfg.replace(**settings), check_budget=False,
                                     pipeline=None if settings.get("offload") else none.pipeline, assemble=False)
        except LynxError as err:
            row[label] = {"error": str(err)[:200]}
            continue
        row[label] = {"step_s": out.sim.step_time_s, "ratio": out.sim.step_time_s / t0, "fits": out.sim.fits_budget,
                      "exposed_recompute_ms": out.sim.exposed_recompute_s * 1e3,
                      "exposed_copy_ms": out.sim.exposed_copy_s * 1e3,
                      "offloaded_mb": [b / 2**20 for b in out.sim.offloaded_bytes],
                      "wall_s": time.perf_counter() - started}
        if label == "heu+offload":
            pipe = out.pipeline
            stages = []
            for p in out.problems:
                blocks = [b for c in pipe.device_chunks(p.stage) for b in c.blocks]
                stages.append(stage_bound(p, t0, sum(pipe.costs[b].forward_s + pipe.costs[b].tp_forward_s
                                                     for b in blocks),
                                          sum(pipe.costs[b].backward_s + pipe.costs[b].tp_backward_s for b in blocks)))
            row["stages"] = stages
            row["bound_s"] = max(s["bound_s"] for s in stages)
            row["bound_ratio"] = row["bound_s"] / t0
    return row


def main(argv: list[str] | None = None) -> int:
    from grid import profiled_graphs, retimed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opt", action="store_true", help="also OPT with offload (10 s per stage solve) on the "
                    "--opt-models points")
    ap.add_argument("--opt-models", default=OPT_MODELS)
    ap.add_argument("--points", default="", help='";"-separated "model hardware pp tp microbatches"')
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    points = ([(p.split()[0], p.split()[1], *map(int, p.split()[2:])) for p in args.points.split(";") if p.strip()]
              or list(POINTS))
    started = time.perf_counter()
    graphs = profiled_graphs(sorted({p[0] for p in points}))
    rows = []
    head = ("| point | T0 ms | bound / T0 | HEU+offload / T0 | recompute-only HEU / T0 | OPT+offload / T0 | "
            "binding stage (in flight): MiB per microbatch that must leave | there: streamed / prefetched / "
            "window-recomputed (before, inside the backward) / on demand MiB | its windows ms (before, inside) | "
            "its exposed ms |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    print(head, flush=True)
    for model, hw, pp, tp, m in points:
        row = bench_point(retimed(graphs[model], hw), model, hw, pp, tp, m,
                          tuple(args.opt_models.split(",")) if args.opt else ())
        rows.append(row)
        if "stages" not in row:
            lines.append(f"| {row['point']} | {row['none_step_s'] * 1e3:.1f} | error: "
                         f"{row['heu+offload'].get('error', '')[:80]} | | | | | | | |")
        else:
            s = max(row["stages"], key=lambda st: (st["bound_s"], st["must_mb"]))
            cell = lambda label: (f"{row[label]['ratio']:.4f}×" + ("" if row[label]["fits"] else " (over)")  # noqa: E731
                                  if "ratio" in row.get(label, {}) else row.get(label, {}).get("error", "")[:40])
            lines.append(f"| {row['point']} | {row['none_step_s'] * 1e3:.1f} | {row['bound_ratio']:.4f}× | "
                         f"{cell('heu+offload')} | {cell('heu')} | {cell('opt+offload')} | "
                         f"s{s['stage']} ({s['in_flight']}): {s['must_mb']:.0f} | {s['streamed_mb']:.0f} / "
                         f"{s['prefetched_mb']:.0f} / {s['window_before_mb']:.0f}, {s['window_inside_mb']:.0f} / "
                         f"{s['on_demand_mb']:.0f} | {s['windows_before_ms']:.1f}, {s['windows_inside_ms']:.1f} | "
                         f"{s['exposed_ms']:.2f} |")
        print(lines[-1], flush=True)
    ok = [r for r in rows if "bound_ratio" in r and "ratio" in r.get("heu+offload", {})]
    summary = [
        f"points: {len(rows)} ({len(ok)} planned); wall {time.perf_counter() - started:.0f} s; load average "
        f"{os.getloadavg()[0]:.1f}",
        f"bound / T0: median {statistics.median(r['bound_ratio'] for r in ok):.4f}×, max "
        f"{max(r['bound_ratio'] for r in ok):.4f}×" if ok else "bound: none",
        f"HEU with offload / T0: median {statistics.median(r['heu+offload']['ratio'] for r in ok):.4f}×, max "
        f"{max(r['heu+offload']['ratio'] for r in ok):.4f}×" if ok else "",
        "HEU with offload / bound: median "
        f"{statistics.median(r['heu+offload']['step_s'] / r['bound_s'] for r in ok):.4f}×"
        f", max {max(r['heu+offload']['step_s'] / r['bound_s'] for r in ok):.4f}×" if ok else "",
    ]
    with_opt = [r for r in ok if "ratio" in r.get("opt+offload", {})]
    if with_opt:
        summary.append("OPT with offload never below the bound: "
                       + ("YES" if all(r["opt+offload"]["step_s"] >= r["bound_s"] - 1e-12 for r in with_opt) else "NO")
                       + f" ({len(with_opt)} points)")
    print("\n".join(summary))
    md = ["# Level 0.0 with offload: a lower bound from the hardware model vs HEU's and OPT's simulated steps", "",
          f"Command: `.venv/bin/python benchmarks/offload_bound.py {' '.join(argv or sys.argv[1:])}`", "",
          "Budget: `full`'s peak (the grid's level 0.0); T0: `none`'s step. The bound and its terms are "
          "explained in the script's docstring; the binding stage is the one whose bound is largest "
          "(ties: the most bytes that must leave).", "", "```", *summary, "```", "", *lines]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload_bound.md").write_text("\n".join(md) + "\n")
    (args.out / "offload_bound.json").write_text(json.dumps({"argv": argv or sys.argv[1:], "summary": summary,
                                                             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
