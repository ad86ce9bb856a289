"""HEU whole plans as a user meets them: a fresh process (cold), a warm one, and `lynx plan`.

The points of issue 17 (pp 4, 8 microbatches, 1F1B, h100-sxm, HEU): the ``llama-7b`` preset and
``transformers``' LlamaForCausalLM with Llama 2 7B's config (bf16, sdpa, meta device:
``benchmarks/hf_llama.py``), at 40 GiB (recomputation needed) and 60 GiB (none needed).

* **cold**: a fresh interpreter per measurement runs ``lynx.compile`` and reports the plan's
  ``search_time_s`` (solver time over every stage and round; importing the solver is the
  ``setup`` phase, not search), its phases (``Compiled.phases``), whether OR-tools was
  imported, and the process's CPU seconds; median of ``--repeats``;
* **warm**: one process analyses the model once and plans it ``--repeats`` times (HEU's caches
  cleared before each, as a new model would find them); median ``search_time_s``;
* with each search time, the solver's CPU seconds (``time.process_time`` around every solve):
  the machine is shared, and under load wall time measures the other jobs as much as HEU;
* **lynx plan**: ``lynx plan MODEL --pp 4 -m 8 --hardware h100-sxm -b BUDGET`` as a
  subprocess: wall and CPU seconds (children's rusage), and the phases it prints.

Bars (issue 17): cold ``search_time_s`` ≤ 0.16 s at 40 GiB for both models, ≤ 0.02 s at 60 GiB;
``lynx plan llama-7b … -b 40GiB`` ≤ 5 s wall. The 1-minute load average of the 2 shared cores is
recorded with every figure.

    .venv/bin/python benchmarks/search_plan.py                 # ~3 min
    .venv/bin/python benchmarks/search_plan.py --repeats 3 --points llama-7b@40GiB

Writes benchmarks/results/search_plan.{md,json}; also run by ``benchmarks/search_time.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LYNX = Path(sys.executable).with_name("lynx")

# name -> MODEL argument (a preset or module:factory)
MODELS = {"llama-7b": "llama-7b", "hf-llama-7b": f"{ROOT / 'benchmarks' / 'hf_llama.py'}:llama_7b"}
POINTS = [("llama-7b", "40GiB"), ("llama-7b", "60GiB"), ("hf-llama-7b", "40GiB"), ("hf-llama-7b", "60GiB")]
SETTINGS = dict(pp=4, microbatches=8, hardware="h100-sxm", solver="heu")
BARS = {"40GiB": 0.16, "60GiB": 0.02}

_COLD = """
import json, resource, sys, time
import lynx
import lynx.solvers
from lynx.models import resolve_model
cpu, registry_solve = [0.0], lynx.solvers.solve


def timed(*args, **kw):  # the registry's solve, its CPU seconds counted (the loop looks it up per plan)
    started = time.process_time()
    try:
        return registry_solve(*args, **kw)
    finally:
        cpu[0] += time.process_time() - started


lynx.solvers.solve = timed
resolved = resolve_model({spec!r})
compiled = lynx.compile(resolved.model, resolved.example_inputs, memory_budget={budget!r}, **{settings!r})
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"search_s": compiled.plan.search_time_s, "search_cpu_s": cpu[0], "phases": dict(compiled.phases),
                  "step_s": compiled.plan.predicted.step_time_s, "iterations": compiled.plan.iterations,
                  "fits": compiled.plan.predicted.fits_budget, "ortools": "ortools" in sys.modules,
                  "process_cpu_s": usage.ru_utime + usage.ru_stime}}))
"""


def cold(name: str, budget: str) -> dict[str, Any]:
    """One fresh interpreter compiling ``name`` under ``budget``."""
    code = _COLD.format(spec=MODELS[name], budget=budget, settings=SETTINGS)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if run.returncode:
        raise RuntimeError(f"cold plan of {name} at {budget} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def warm(name: str, budget: str, repeats: int) -> tuple[list[float], list[float]]:
    """``search_time_s`` of ``repeats`` plans in this process (analysed once, HEU caches cleared),
    and the solver's CPU seconds of each."""
    from lynx.config import CompileConfig
    from lynx.frontend.analyze import analyze
    from lynx.models import resolve_model
    from lynx.planner.loop import plan_graph_outcome
    from lynx.solvers import solve
    from lynx.solvers.heu.solve import clear_cache

    resolved = resolve_model(MODELS[name])
    graph = analyze(resolved.model, resolved.example_inputs, hardware=SETTINGS["hardware"]).graph
    config = CompileConfig(memory_budget=budget, **SETTINGS)
    plan_graph_outcome(graph, config, assemble=False)  # (imports, first calls)
    cpu = [0.0]

    def timed(*args: Any, **kw: Any) -> Any:
        started = time.process_time()
        try:
            return solve(*args, **kw)
        finally:
            cpu[0] += time.process_time() - started

    times, cpus = [], []
    for _ in range(repeats):
        clear_cache()
        cpu[0] = 0.0
        times.append(plan_graph_outcome(graph, config, solve=timed).search_time_s)
        cpus.append(cpu[0])
    return times, cpus


def lynx_plan(name: str, budget: str, out: Path) -> dict[str, Any]:
    """``lynx plan`` as a subprocess: wall and CPU seconds, and the phases line it prints."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    run = subprocess.run([str(LYNX), "plan", MODELS[name], "--pp", "4", "-m", "8", "--hardware", "h100-sxm",
                          "-b", budget, "-o", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, COLUMNS="400"))
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode:
        raise RuntimeError(f"lynx plan {name} -b {budget} failed:\n{run.stderr[-3000:]}")
    line = next((ln for ln in run.stderr.splitlines() if ln.startswith("phases:")), "")
    phases = {}
    for part in line.removeprefix("phases:").split("(")[0].split(","):
        if part.strip():
            phase, seconds, _ = part.split()
            phases[phase] = float(seconds)
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "phases": phases}


def bench_point(name: str, budget: str, repeats: int, out: Path) -> dict[str, Any]:
    colds = [cold(name, budget) for _ in range(repeats)]
    warms, warm_cpus = warm(name, budget, repeats)
    clis = [lynx_plan(name, budget, out / "search_plan_cli.json") for _ in range(max(1, repeats // 2))]
    load = os.getloadavg()[0]
    (out / "search_plan_cli.json").unlink(missing_ok=True)
    median_cli = sorted(clis, key=lambda c: c["wall_s"])[len(clis) // 2]
    row = {
        "model": name, "budget": budget, "cold_search_s": [c["search_s"] for c in colds],
        "cold_median_s": statistics.median(c["search_s"] for c in colds),
        "cold_cpu_median_s": statistics.median(c["search_cpu_s"] for c in colds),
        "cold_phases": {k: statistics.median(c["phases"].get(k, 0.0) for c in colds) for k in colds[0]["phases"]},
        "cold_process_cpu_s": statistics.median(c["process_cpu_s"] for c in colds),
        "ortools_imported": any(c["ortools"] for c in colds), "iterations": colds[0]["iterations"],
        "step_s": colds[0]["step_s"], "fits": colds[0]["fits"],
        "warm_search_s": warms, "warm_median_s": statistics.median(warms),
        "warm_cpu_median_s": statistics.median(warm_cpus),
        "cli_wall_s": [c["wall_s"] for c in clis], "cli_cpu_s": [c["cpu_s"] for c in clis],
        "cli_wall_median_s": median_cli["wall_s"], "cli_cpu_median_s": statistics.median(c["cpu_s"] for c in clis),
        "cli_phases": median_cli["phases"], "bar_s": BARS.get(budget), "load_average": load,
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"{name} {budget}: HEU search cold {row['cold_median_s'] * 1e3:.1f} ms, solver CPU "
          f"{row['cold_cpu_median_s'] * 1e3:.1f} ms (bar {row['bar_s'] * 1e3:.0f}; {row['iterations']} rounds, "
          f"OR-tools imported: {row['ortools_imported']}), warm {row['warm_median_s'] * 1e3:.1f} ms, CPU "
          f"{row['warm_cpu_median_s'] * 1e3:.1f} ms; lynx plan {row['cli_wall_median_s']:.2f} s wall, "
          f"{row['cli_cpu_median_s']:.2f} s CPU; load {load:.1f}", flush=True)
    return row


def write_outputs(rows: list[dict[str, Any]], out: Path) -> None:
    lines = ["# HEU whole plans: cold (fresh process), warm, and `lynx plan` (pp 4, m 8, 1F1B, h100-sxm)", "",
             "Command: `.venv/bin/python benchmarks/search_plan.py` (also run by `benchmarks/search_time.py`)", "",
             "| model | budget | HEU search, cold (median; solver CPU) | bar | warm (median; CPU) | rounds | "
             "OR-tools imported | step ms | `lynx plan` wall s | CPU s | its phases (s) | load |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["cli_phases"].items())
        bar = "-" if r["bar_s"] is None else f"{r['bar_s'] * 1e3:.0f} ms"
        lines.append(f"| {r['model']} | {r['budget']} | {r['cold_median_s'] * 1e3:.1f} ms; "
                     f"{r['cold_cpu_median_s'] * 1e3:.1f} ms | {bar} | {r['warm_median_s'] * 1e3:.1f} ms; "
                     f"{r['warm_cpu_median_s'] * 1e3:.1f} ms | "
                     f"{r['iterations']} | {'yes' if r['ortools_imported'] else 'no'} | {r['step_s'] * 1e3:.2f} | "
                     f"{r['cli_wall_median_s']:.2f} | {r['cli_cpu_median_s']:.2f} | {phases} | "
                     f"{r['load_average']:.1f} |")
    (out / "search_plan.md").write_text("\n".join(lines) + "\n")
    (out / "search_plan.json").write_text(json.dumps(rows, indent=1))


def main(points: list[tuple[str, str]] | None = None, repeats: int = 5,
         out: Path = ROOT / "benchmarks" / "results") -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [bench_point(name, budget, repeats, out) for name, budget in (points or POINTS)]
    fresh = {(r["model"], r["budget"]) for r in rows}
    previous = out / "search_plan.json"
    if previous.exists():  # --points re-runs some rows: the others stay as the last run left them
        kept = [r for r in json.loads(previous.read_text()) if (r["model"], r["budget"]) not in fresh]
        order = {p: i for i, p in enumerate(POINTS)}
        rows = sorted(kept + rows, key=lambda r: order.get((r["model"], r["budget"]), len(order)))
    write_outputs(rows, out)
    print(f"wrote {out / 'search_plan.md'}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=",".join(f"{m}@{b}" for m, b in POINTS),
                        help="comma-separated MODEL@BUDGET (models: " + ", ".join(MODELS) + ")")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = parser.parse_args()
    chosen = [tuple(p.split("@")) for p in a.points.split(",")]
    main(chosen, a.repeats, a.out)  # type: ignore[arg-type]
