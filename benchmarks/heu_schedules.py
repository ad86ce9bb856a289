"""HEU's whole plans on zero-bubble and interleaved devices: step time, replayed peaks, search CPU.

Per configuration (model, hardware, pp, microbatches, schedule, budget; virtual stages 2), HEU
plans the model as ``lynx plan`` does (``plan_graph_outcome``, the GPT presets captured once on
the meta device and re-timed per hardware, as ``grid.py`` does) with cold caches, ``--repeats``
times. Prints the simulated step time, every stage's replayed peak against its budget
(``lynx.solvers.memory_replay``: a plan over it is a bug), and the search CPU seconds — the
process time summed over the solver calls, the least of the repeats (the machine is shared:
wall time measures the other jobs as much as HEU) — and the number of Python function calls
inside them (cProfile, one more run, not timed), which the load does not change at all. Writes a JSON file
for comparing two trees: run this script in each (e.g. a ``git worktree`` of the base).

    .venv/bin/python benchmarks/heu_schedules.py --out /tmp/after.json
    .venv/bin/python benchmarks/heu_schedules.py --only "gpt-20b" --repeats 1
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grid  # noqa: E402  (puts the repository on sys.path)

from lynx.config import CompileConfig  # noqa: E402
from lynx.errors import LynxError  # noqa: E402
from lynx.planner.loop import plan_graph_outcome  # noqa: E402
from lynx.solvers import solve as registry_solve  # noqa: E402
from lynx.solvers.heu.solve import clear_cache  # noqa: E402
from lynx.solvers.memory_replay import replay_peak_bytes  # noqa: E402

# model, hardware, pp, microbatches, schedule, budget GiB (benchmarks/results/heu_chunks.md's ZB-H1 points)
CONFIGS = [
    ("gpt-1.3b", "a100-80g", 4, 8, "zbh1", 14), ("gpt-1.3b", "a100-80g", 4, 8, "zbh1", 10),
    ("gpt-1.3b", "a100-80g", 4, 8, "zbh1", 8), ("gpt-1.3b", "h100-sxm", 4, 16, "zbh1", 16),
    ("gpt-1.3b", "h100-sxm", 4, 16, "zbh1", 10), ("gpt-1.3b", "a100-80g", 2, 8, "zbh1", 20),
    ("gpt-1.3b", "a100-80g", 2, 8, "zbh1", 14), ("gpt-1.3b", "a100-80g", 8, 8, "zbh1", 8),
    ("gpt-2.7b", "a100-80g", 4, 8, "zbh1", 20), ("gpt-2.7b", "h100-sxm", 8, 16, "zbh1", 12),
    ("gpt-2.7b", "h100-sxm", 2, 16, "zbh1", 30), ("gpt-20b", "a100-80g", 8, 8, "zbh1", 64),
    ("gpt-20b", "a100-80g", 8, 8, "zbh1", 56),
    ("gpt-1.3b", "a100-80g", 4, 8, "interleaved1f1b", 10), ("gpt-1.3b", "a100-80g", 4, 8, "interleaved1f1b", 8),
]


def plan_point(graph: Any, model: str, hw: str, pp: int, m: int, schedule: str, gib: int, repeats: int) -> dict:
    cfg = CompileConfig(pp=pp, tp=1, microbatches=m, hardware=hw, solver="heu", memory_budget=gib << 30,
                        schedule=schedule, virtual_stages=2)
    spent = [0.0]
    profile = cProfile.Profile()

    profiling = [False]

    def timed(name: str, problem: Any, **kw: Any) -> Any:
        c0 = time.process_time()
        if profiling[0]:
            profile.enable()
        try:
            return registry_solve(name, problem, **kw)
        finally:
            profile.disable()
            spent[0] += time.process_time() - c0

    best = None
    for k in range(repeats + 1):   # the last one counts calls (the profiler slows it: not timed)
        clear_cache()
        spent[0], profiling[0] = 0.0, k == repeats
        out = plan_graph_outcome(graph, cfg, check_budget=False, assemble=False, solve=timed)
        if k < repeats:
            best = spent[0] if best is None else min(best, spent[0])
    peaks = [(replay_peak_bytes(p, r.assignment), p.activation_budget_bytes) for p, r in zip(out.problems, out.results)]
    return {"step_ms": out.sim.step_time_s * 1e3, "search_cpu_s": best, "calls": pstats.Stats(profile).total_calls,
            "peaks": peaks, "over_budget": sum(peak > budget for peak, budget in peaks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="only the configurations whose name contains this")
    ap.add_argument("--out", type=Path, default=None, help="JSON file of the figures")
    args = ap.parse_args()
    points = [c for c in CONFIGS if args.only in " ".join(map(str, c))]
    graphs = grid.profiled_graphs(sorted({c[0] for c in points}))
    rows: dict[str, Any] = {}
    for model, hw, pp, m, schedule, gib in points:
        name = f"{model} {hw} pp{pp} m{m} {schedule} {gib}GiB"
        try:
            rows[name] = plan_point(grid.retimed(graphs[model], hw), model, hw, pp, m, schedule, gib, args.repeats)
        except LynxError as err:
            rows[name] = {"error": f"{type(err).__name__}: {err}"[:200]}
            print(f"{name}: {rows[name]['error']}", flush=True)
            continue
        r = rows[name]
        print(f"{name}: step {r['step_ms']:.2f} ms, search CPU {r['search_cpu_s']:.3f} s ({r['calls']} calls), "
              f"replayed peaks over budget: {r['over_budget']}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
