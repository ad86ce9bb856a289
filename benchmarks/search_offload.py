"""HEU's cold search time with offload: the whole plan, gpt-20b (and others) on h100-sxm.

The point of ``benchmarks/search_time.py``'s whole-plan section — pp 4, 1F1B, 8 microbatches,
h100-sxm (PCIe 5.0 host link), the budget 30% of the way from `full`'s peak to `none`'s —
planned by HEU with ``offload=True`` and without, cold (HEU's structure cache and the offload
sets chosen before forgotten before each plan), median of ``--repeats``: the planning loop's
solver time over every round (the plan's ``search_time_s``), the solver's CPU time, the rounds,
and the step time the simulator predicts. The bar (issue 24): HEU with offload plans gpt-20b in
≤ 0.16 s. Run it alone (``flock /tmp/notes/bench.lock``); the load average is recorded.

    .venv/bin/python benchmarks/search_offload.py                 # gpt-20b, 5 repeats
    .venv/bin/python benchmarks/search_offload.py --models gpt-1.3b,gpt-20b --repeats 7

Writes benchmarks/results/search_offload.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lynx.config import CompileConfig  # noqa: E402
from lynx.planner.loop import plan_graph_outcome  # noqa: E402
from search_time import cold_outcome, level_budget  # noqa: E402

BAR_S = 0.16


def cold_plan(graph: Any, config: CompileConfig, pipe: Any) -> dict[str, Any]:
    """One cold whole plan: solver wall and CPU seconds, rounds, predicted step."""
    out, cpu_s = cold_outcome(graph, config, pipe)
    return {"search_s": out.search_time_s, "cpu_s": cpu_s, "rounds": out.iterations,
            "step_s": out.sim.step_time_s, "fits": out.sim.fits_budget,
            "offloaded_nodes": sum(len(r.assignment.offload) for r in out.results)}


def bench(model: str, repeats: int, level: float) -> dict[str, Any]:
    from lynx.frontend.analyze import analyze
    from lynx.models import resolve_model

    resolved = resolve_model(model)
    graph = analyze(resolved.model, resolved.example_inputs, target="cuda", hardware="h100-sxm").graph
    base, none, _full, budget = level_budget(graph, level)
    row: dict[str, Any] = {"model": model, "level": level, "budget": budget, "none_step_s": none.sim.step_time_s}
    for label, offload in (("offload", True), ("recompute_only", False)):
        config = base.replace(solver="heu", memory_budget=budget, offload=offload)
        pipe = plan_graph_outcome(graph, config.replace(solver="none"), check_budget=False, assemble=False).pipeline
        runs = [cold_plan(graph, config, pipe) for _ in range(repeats)]
        row[label] = {"search_median_s": statistics.median(r["search_s"] for r in runs),
                      "search_min_s": min(r["search_s"] for r in runs),
                      "cpu_median_s": statistics.median(r["cpu_s"] for r in runs),
                      "rounds": runs[0]["rounds"], "step_s": runs[0]["step_s"], "fits": runs[0]["fits"],
                      "offloaded_nodes": runs[0]["offloaded_nodes"], "runs": runs}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-20b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--level", type=float, default=0.3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    lines = ["# HEU's cold whole-plan search time with offload (h100-sxm, pp 4, 1F1B, m 8)", "",
             f"Command: `.venv/bin/python benchmarks/search_offload.py {' '.join(argv or sys.argv[1:])}`", "",
             "| model | level | HEU+offload search s (median / min; CPU) | rounds | step / no-recompute step | "
             "offloaded nodes | recompute-only HEU search s (median; CPU) | its step / no-recompute step |",
             "|---|---|---|---|---|---|---|---|"]
    for model in [m for m in args.models.split(",") if m]:
        row = bench(model, args.repeats, args.level)
        rows.append(row)
        off, plain = row["offload"], row["recompute_only"]
        lines.append(f"| {model} | {args.level} | {off['search_median_s']:.3f} / {off['search_min_s']:.3f}; "
                     f"{off['cpu_median_s']:.3f} | {off['rounds']} | {off['step_s'] / row['none_step_s']:.4f}× | "
                     f"{off['offloaded_nodes']} | {plain['search_median_s']:.3f}; {plain['cpu_median_s']:.3f} | "
                     f"{plain['step_s'] / row['none_step_s']:.4f}× |")
        print(lines[-1], flush=True)
    load_after = os.getloadavg()
    lines += ["", f"Bar: HEU with offload plans gpt-20b in ≤ {BAR_S} s (median, cold). Load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores."]
    print(lines[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search_offload.md").write_text("\n".join(lines) + "\n")
    (args.out / "search_offload.json").write_text(json.dumps(
        {"rows": rows, "load_before": load_before, "load_after": load_after}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
