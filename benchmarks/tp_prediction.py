"""Tensor-parallel step time, predicted with ``--hardware auto`` against measured (issue 23's bar).

For pp 1 × tp 2 (2 processes) and pp 2 × tp 2 (4 processes), gpt-tiny at seq 32 × 4, 4
microbatches, AdamW, HEU: ``lynx plan ... --hardware auto -o plan.json`` then ``torchrun
examples/train_gpt.py --plan plan.json`` (the documented TP run, docs/tensor_parallel.md), and
for pp 2 × tp 2 also the plan ``train_gpt.py`` makes itself with ``--hardware auto``. Both plan the
4 ranks on the 2 cores (``lynx.planner.hardware.share_cores``: half a core each while all run, the
cores shared among the busy ranks while a stage waits, ``lynx.planner.core_sharing``). Per run:
the load average before and after, the predicted step, the measured median and fastest step (the
first step left out) and their ratios to the prediction. The bar: 0.8-1.25 — the median where
the load is within the summary's margin of the calibration's, else the fastest step
(docs/hardware.md). Each row keeps every step's time (``step_times_s``, the first one the
warm-up the median leaves out): 60 steps, ~7 s a run, as 30 let a few seconds' burst move the
median. Each training runs in a session of its own whose niceness is ``--nice`` (root: -10, as
``main_job_prediction.py``), so other sessions' jobs disturb it less.

    flock /tmp/notes/bench.lock python benchmarks/tp_prediction.py --runs 2 --json benchmarks/results/tp_prediction.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shared_machine import renice_session  # noqa: E402

SHAPE = ["--seq", "32", "--microbatch", "4"]
# (name, processes, pp, budget, planned by): budgets the HEU plan fits at each mesh
CASES = [("pp1xtp2", 2, 1, "3.5MiB", "lynx plan"), ("pp2xtp2", 4, 2, "2.5MiB", "lynx plan"),
         ("pp2xtp2", 4, 2, "2.5MiB", "train_gpt")]


def _run(command: list[str], nice: int) -> str:
    done = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900, start_new_session=True, preexec_fn=lambda: renice_session(nice))
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def one_run(case: tuple, steps: int, folder: Path, index: int, nice: int) -> dict:
    name, procs, pp, budget, planner = case
    mesh = ["--pp", str(pp), "--tp", "2"]
    settings = [*mesh, "--optimizer", "adamw", "-b", budget, "--hardware", "auto"]
    log = folder / f"{name}-{planner.replace(' ', '_')}-{index}.json"
    train = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
             str(ROOT / "examples" / "train_gpt.py"), *SHAPE, "--steps", str(steps), "--log-json", str(log)]
    if planner == "lynx plan":
        plan = folder / f"{name}-{index}.plan.json"
        _run([sys.executable, "-c", "from lynx.cli import main; main()", "plan", "gpt-tiny", *SHAPE, "-m", "4",
              *settings, "-o", str(plan)], nice)
        train += ["--plan", str(plan)]
    else:
        train += [*mesh, "--dp", "1", "--microbatches", "4", "--optimizer", "adamw", "--memory-budget", budget,
                  "--hardware", "auto"]
    load_before = os.getloadavg()[0]
    out = _run(train, nice)
    record = json.loads(log.read_text())
    summary = record["summary"]
    predicted = summary["predicted_step_s"]
    return {
        "mesh": name, "planned_by": planner, "run": index, "load_before": load_before,
        "load_after": os.getloadavg()[0], "predicted_step_s": predicted, "step_s": summary["step_s"],
        "fastest_step_s": summary["fastest_step_s"], "median_ratio": summary["step_s"] / predicted,
        "fastest_ratio": summary["fastest_step_s"] / predicted,
        # what the run summary measured beside the loads: other jobs' cpus (the host's CPU time less the
        # run's) and the busiest rank's CPU time per step over the plan's busy time (the cores' speed)
        "others_cpus": (summary.get("load") or {}).get("others_cpus"),
        "cpu_ratio": (summary.get("load") or {}).get("cpu_ratio"),
        "hardware": next((line for line in out.splitlines() if line.startswith("hardware ")), ""),
        "nice": nice,
        "step_times_s": record.get("step_times_s"),   # every step's, the slowest rank's (train_gpt.py)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--calibrate", action="store_true", help="run `lynx calibrate` first (refreshes auto)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--nice", type=int, default=-10, help="niceness of each run's session (root)")
    args = ap.parse_args()
    if args.calibrate:
        subprocess.run([sys.executable, "-c", "from lynx.cli import main; main()", "calibrate"], check=True,
                       start_new_session=True, preexec_fn=lambda: renice_session(args.nice))
    rows = []
    with tempfile.TemporaryDirectory(prefix="lynx-tp-prediction-") as folder:
        for i in range(args.runs):
            for case in CASES:   # interleaved: the meshes see the same stretch of load
                r = one_run(case, args.steps, Path(folder), i + 1, args.nice)
                rows.append(r)
                ok = lambda x: "within" if 0.8 <= x <= 1.25 else "NOT within"  # noqa: E731
                print(f"{r['mesh']} ({r['planned_by']}) run {r['run']}: load {r['load_before']:.2f} → "
                      f"{r['load_after']:.2f}; predicted {r['predicted_step_s'] * 1e3:.1f} ms, measured median "
                      f"{r['step_s'] * 1e3:.1f} ms ({r['median_ratio']:.2f}, {ok(r['median_ratio'])}), fastest "
                      f"{r['fastest_step_s'] * 1e3:.1f} ms ({r['fastest_ratio']:.2f}, {ok(r['fastest_ratio'])})"
                      + (f"; other jobs {r['others_cpus']:.2f} cpus" if r["others_cpus"] is not None else "")
                      + (f"; CPU time per step {r['cpu_ratio']:.2f}× the plan's busy time" if r["cpu_ratio"] else ""),
                      flush=True)
    print(rows[0]["hardware"])
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows}, indent=1))


if __name__ == "__main__":
    main()
