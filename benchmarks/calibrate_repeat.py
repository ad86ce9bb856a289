"""Is `lynx calibrate` repeatable? N calibrations in a row, each figure side by side.

Runs ``lynx calibrate`` ``--runs`` times, each in a process of its own writing a file of its
own (the user's cache is left alone), and prints per run the load average before it, the
seconds it took and every figure the README main job's prediction uses; then per figure the
largest run over the smallest, and whether all runs sit within ±10% of their median (the bar
of issue 26, on a quiet machine), and the figures each run flagged unreliable. Last, what the
spread means for the user: the README main job's plan (gpt-tiny seq 64 × 8, pp 2 × 4
microbatches, DeMo, HEU under 12 MiB) predicted with each run's file, and how much that prediction
moves when one figure is 20% worse (slower) in the last run's file: which figures' spread matters.

    python benchmarks/calibrate_repeat.py --runs 3 --json benchmarks/results/calibrate_repeat.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx.planner.hardware_files import load_hardware_file  # noqa: E402

# what the main job's prediction uses (fp32 gpt-tiny, DeMo, gloo p2p), in display units
FIGURES = {
    "peak_flops.float32": (lambda s: s.peak_flops["float32"], 1e-9, "GFLOP/s"),
    "memory_bandwidth": (lambda s: s.memory_bandwidth, 1e-9, "GB/s"),
    "rng_s_per_element": (lambda s: s.rng_s_per_element, 1e9, "ns"),
    "op_overhead_s": (lambda s: s.op_overhead_s, 1e6, "µs"),
    "runtime_action_s": (lambda s: s.runtime_action_s, 1e6, "µs"),
    "optimizer_s_per_param.demo": (lambda s: s.optimizer_s_per_param["demo"], 1e9, "ns"),
    "links.alpha_s": (lambda s: s.links["pp"].alpha_s, 1e6, "µs"),
    "links.beta_bytes_per_s": (lambda s: s.links["pp"].beta_bytes_per_s, 1e-9, "GB/s"),
}


MAIN_JOB = dict(pp=2, dp=1, microbatches=4, optimizer="demo", memory_budget="12MiB", solver="heu")


def main_job_step_s(hardware: Any) -> float:
    """The README main job's predicted step time on ``hardware`` (a file or a spec; 2 ranks, a core each)."""
    import lynx

    resolved = lynx.models.resolve_model("gpt-tiny", seq=64, microbatch=8, device="cpu")  # as train_gpt.py
    hardware = str(hardware) if isinstance(hardware, Path) else hardware   # CompileConfig takes a str path
    compiled = lynx.compile(resolved.model, resolved.example_inputs, hardware=hardware, **MAIN_JOB)
    return compiled.plan.predicted.step_time_s


def worse(spec: Any, figure: str, by: float = 1.2) -> Any:
    """``spec`` with ``figure`` ``by`` times slower: a time ×by, a rate ÷by."""
    factor = 1 / by if figure in ("peak_flops.float32", "memory_bandwidth", "links.beta_bytes_per_s") else by
    if figure.startswith("links."):
        key = figure.split(".", 1)[1]
        links = {n: link.model_copy(update={key: getattr(link, key) * factor}) for n, link in spec.links.items()}
        return spec.model_copy(update={"links": links})
    if "." in figure:
        field, key = figure.split(".", 1)
        return spec.model_copy(update={field: {**getattr(spec, field), key: getattr(spec, field)[key] * factor}})
    return spec.model_copy(update={figure: getattr(spec, figure) * factor})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lynx-calibrate-repeat-") as folder:
        for i in range(args.runs):
            load = os.getloadavg()[0]
            out = Path(folder) / f"run{i + 1}.json"
            env = dict(os.environ, LYNX_CACHE_DIR=str(Path(folder) / f"cache{i + 1}"))
            subprocess.run([sys.executable, "-m", "lynx.calibrate", "--output", str(out)], env=env, check=True,
                           stderr=subprocess.DEVNULL)
            spec = load_hardware_file(out)
            cal = spec.calibration
            row = {"run": i + 1, "load_before": load, "seconds": cal.seconds,
                   "load": [cal.load_before, cal.load_after],
                   "figures": {k: get(spec) for k, (get, _, _) in FIGURES.items()},
                   "cpu_share": cal.cpu_share, "unreliable": sorted(cal.unreliable)}
            row["main_job_step_s"] = main_job_step_s(out)
            rows.append(row)
            figures = ", ".join(f"{k} {row['figures'][k] * scale:.4g} {unit}"
                                for k, (_, scale, unit) in FIGURES.items())
            print(f"run {i + 1}: load {load:.2f} (calibration's own {cal.load_before:.2f} → {cal.load_after:.2f}), "
                  f"{cal.seconds:.1f} s; {figures}; main job predicted {row['main_job_step_s'] * 1e3:.2f} ms; "
                  f"unreliable: {', '.join(row['unreliable']) or 'none'}", flush=True)
    base = main_job_step_s(spec)
    sensitivity = {k: main_job_step_s(worse(spec, k)) / base - 1 for k in FIGURES}
    summary = {}
    for k, (_, scale, unit) in FIGURES.items():
        values = [r["figures"][k] for r in rows]
        mid = statistics.median(values)
        worst = max(abs(v - mid) / mid for v in values) if mid else 0.0
        summary[k] = {"max_over_min": max(values) / min(values), "worst_from_median": worst,
                      "main_job_change_if_20pct_worse": sensitivity[k]}
        runs = " ".join(f"{v * scale:9.4g}" for v in values)
        print(f"{k:30s} {runs} {unit:8s} max/min {max(values) / min(values):.3f}  "
              f"{'within' if worst <= 0.10 else 'NOT within'} ±10% of the median ({worst:.1%}); 20% slower "
              f"moves the main job {sensitivity[k]:+.2%}")
    steps = [r["main_job_step_s"] for r in rows]
    mid = statistics.median(steps)
    summary["main_job_step_s"] = {"max_over_min": max(steps) / min(steps),
                                  "worst_from_median": max(abs(v - mid) / mid for v in steps)}
    print(f"{'main job predicted step':30s} {' '.join(f'{v * 1e3:9.4g}' for v in steps)} ms       max/min "
          f"{max(steps) / min(steps):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
