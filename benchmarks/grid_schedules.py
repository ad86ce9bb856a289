"""The grid across schedules: 1F1B, interleaved 1F1B and zero bubble (ZB-H1), simulated.

``grid.py``'s grid with the schedules (a part of it in a file of its own: it uses ``grid.py``'s
capture, re-timing and records, and asks another question — which schedule, not which solver).

Per configuration (gpt-1.3b … gpt-20b × a100-80g, h100-sxm × pp 4, 8 × tp 1, 2, 4, 8
microbatches, AdamW) and per budget level, every schedule is planned at the **same** memory
budget — ``full_peak + level · (none_peak − full_peak)`` of 1F1B, so level 0.0 is "only 1F1B's
full recomputation fits" — with Lynx (HEU) and every baseline (none, full, full-block,
selective, checkmate), each scored by the simulator. Prints, side by side, the best Lynx
schedule's step time and the best baseline schedule's, which schedule Lynx picks, and the
violations of "Lynx is never slower than a baseline that fits on the same schedule".
Interleaved 1F1B runs 2 chunks per device; configurations with fewer than 2 layers per chunk
skip it.

    .venv/bin/python benchmarks/grid_schedules.py          # ~levels 0.3 and 0.0 → grid_schedules.{md,json}
    .venv/bin/python benchmarks/grid_schedules.py --models gpt-1.3b --pp 4 --tp 1
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from lynx.units import format_size  # noqa: E402

SCHEDULES = ("1f1b", "interleaved1f1b", "zbh1")   # what the runtime executes (gpipe: 1F1B's order, more memory)
BASELINES, BUDGETED = grid.BASELINES, grid.BUDGETED


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = grid.grid_parser(__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--levels", default="0.3,0.0")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--checkmate-time-limit", type=float, default=5.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results")
    return p.parse_args(argv)


def _plan(graph: Any, cfg: CompileConfig, pipe: Any = None) -> tuple[dict[str, Any], Any]:
    out = plan_graph_outcome(graph, cfg, check_budget=False, pipeline=pipe, assemble=False)
    return grid.record(out), out.pipeline


def run_point(graph: Any, base: CompileConfig, levels: list[float]) -> list[dict] | str:
    """Every schedule × solver at every level's budget (1F1B's), one configuration."""
    fixed: dict[str, dict[str, Any]] = {}
    pipes: dict[str, Any] = {}
    for schedule in SCHEDULES:
        cfg = base.replace(schedule=schedule)
        fixed[schedule] = {}
        try:
            for solver in BASELINES:
                fixed[schedule][solver], pipes[schedule] = _plan(graph, cfg.replace(solver=solver), pipes.get(schedule))
        except LynxError as err:
            if schedule == "1f1b":
                return f"invalid: {err}"
            del fixed[schedule]
    ref = fixed["1f1b"]
    if ref["full"]["peak"] > base.hardware_spec().memory_bytes:
        return f"full recomputation needs {format_size(ref['full']['peak'])} > device memory"
    rows = []
    for level in levels:
        budget = int(ref["full"]["peak"] + level * (ref["none"]["peak"] - ref["full"]["peak"]))
        row: dict[str, Any] = {"level": level, "budget": budget, "schedules": {}}
        for schedule, baselines in fixed.items():
            results = {s: dict(r, fits=r["peak"] <= budget) for s, r in baselines.items()}
            cfg = base.replace(schedule=schedule, memory_budget=budget)
            for solver in BUDGETED:
                extra = {"time_limit_s": 5.0} if solver == "checkmate" else {}
                try:
                    rec, _ = _plan(graph, cfg.replace(solver=solver, **extra), pipes[schedule])
                    results[solver] = dict(rec, fits=rec["peak"] <= budget)
                except LynxError as err:
                    results[solver] = {"error": str(err), "fits": False}
            row["schedules"][schedule] = results
        rows.append(row)
    return rows


def _task(task: tuple) -> tuple[str, list[dict] | str]:
    model, hw, pp, tp, m, levels, iterations = task
    name = f"{model} {hw} pp{pp} tp{tp} m{m}"
    base = CompileConfig(pp=pp, tp=tp, microbatches=m, hardware=hw, solver="heu", memory_budget=2**50,
                         max_iterations=iterations, virtual_stages=2)
    started = time.perf_counter()
    try:
        rows = run_point(grid._GRAPHS[(model, hw)], base, levels)
    except LynxError as err:
        rows = f"invalid: {err}"
    print(f"{name}: {'skipped, ' + rows if isinstance(rows, str) else 'done'} ({time.perf_counter() - started:.1f} s)",
          flush=True)
    return name, rows


def _best(results: dict[str, Any], solvers: tuple[str, ...]) -> tuple[str, float] | None:
    fitting = [(s, r["step_time_s"]) for s, r in results.items() if s in solvers and r.get("fits")]
    return min(fitting, key=lambda x: x[1]) if fitting else None


def summarise(points: list[dict], levels: list[float]) -> tuple[list[str], list[dict]]:
    lines: list[str] = []
    violations: list[str] = []
    table = []
    speedups: dict[float, list[float]] = {lv: [] for lv in levels}
    vs_megatron: dict[float, list[float]] = {lv: [] for lv in levels}   # none / full / full-block / selective
    picks: dict[float, dict[str, int]] = {lv: {} for lv in levels}
    for pt in points:
        best_lynx, best_base, best_meg = None, None, None
        for schedule, res in pt["schedules"].items():
            lynx = _best(res, ("heu",))
            base = _best(res, BASELINES + ("checkmate",))
            if lynx is None and base is not None:
                violations.append(f"{pt['name']} {schedule}: Lynx found no fitting plan "
                                  f"({res['heu'].get('error', 'its plan does not fit')[:90]}); {base[0]} fits")
            if lynx is not None and base is not None and lynx[1] > base[1] * (1 + 1e-9):
                violations.append(f"{pt['name']} {schedule}: Lynx {lynx[1] * 1e3:.2f} ms slower than "
                                  f"{base[0]} {base[1] * 1e3:.2f} ms")
            if lynx is not None and (best_lynx is None or lynx[1] < best_lynx[1]):
                best_lynx = (schedule, lynx[1])
            if base is not None and (best_base is None or base[1] < best_base[1]):
                best_base = (f"{schedule} {base[0]}", base[1])
            meg = _best(res, BASELINES)
            if meg is not None and (best_meg is None or meg[1] < best_meg[1]):
                best_meg = (f"{schedule} {meg[0]}", meg[1])
        table.append({"name": pt["name"], "budget": pt["budget"], "lynx": best_lynx, "baseline": best_base})
        if best_lynx is not None and best_base is not None:
            speedups[pt["level"]].append(best_base[1] / best_lynx[1])
        if best_lynx is not None and best_meg is not None:
            vs_megatron[pt["level"]].append(best_meg[1] / best_lynx[1])
        if best_lynx is not None:
            picks[pt["level"]][best_lynx[0]] = picks[pt["level"]].get(best_lynx[0], 0) + 1
    lines.append(f"points: {len(points)}; Lynx never slower than a fitting baseline on the same schedule: "
                 f"{'YES' if not violations else 'NO'} ({len(violations)} violation(s))")
    lines += [f"  {v}" for v in violations[:20]]
    for lv in levels:
        xs = speedups[lv]
        if xs:
            lines.append(f"level {lv:.1f}: best Lynx schedule vs best baseline schedule: median speedup "
                         f"{statistics.median(xs):.3f}× (min {min(xs):.3f}×, max {max(xs):.3f}×, {len(xs)} points); "
                         f"Lynx's best schedule: " + ", ".join(f"{s} {n}" for s, n in sorted(picks[lv].items())))
        ys = vs_megatron[lv]
        if ys:
            lines.append(f"level {lv:.1f}: best Lynx schedule vs best Megatron-style baseline schedule (none, full, "
                         f"full-block, selective): median speedup {statistics.median(ys):.3f}× "
                         f"(min {min(ys):.3f}×, max {max(ys):.3f}×, {len(ys)} points)")
    return lines, table


def write_markdown(points: list[dict], table: list[dict], summary: list[str], path: Path, argv: list[str]) -> None:
    out = ["# Lynx grid across schedules: step time (ms), simulated, at 1F1B's budget levels", "",
           f"Command: `.venv/bin/python benchmarks/grid_schedules.py {' '.join(argv)}`", "", "```", *summary, "```", "",
           "| point | budget | " + " | ".join(f"{s} Lynx | {s} best baseline" for s in SCHEDULES)
           + " | best Lynx | best baseline | speedup |",
           "|---|---|" + "---|---|" * len(SCHEDULES) + "---|---|---|"]
    for pt, row in zip(points, table):
        cells = []
        for s in SCHEDULES:
            res = pt["schedules"].get(s)
            if res is None:
                cells += ["n/a", "n/a"]
                continue
            lynx, base = _best(res, ("heu",)), _best(res, BASELINES + ("checkmate",))
            cells += ["-" if lynx is None else f"{lynx[1] * 1e3:.1f}",
                      "-" if base is None else f"{base[1] * 1e3:.1f} ({base[0]})"]
        lx, bs = row["lynx"], row["baseline"]
        speed = f"{bs[1] / lx[1]:.3f}×" if lx and bs else "-"
        out.append(f"| {pt['name']} | {format_size(pt['budget'])} | " + " | ".join(cells)
                   + f" | {'-' if not lx else f'{lx[1] * 1e3:.1f} ({lx[0]})'} | "
                   + f"{'-' if not bs else f'{bs[1] * 1e3:.1f} ({bs[0]})'} | {speed} |")
    path.write_text("\n".join(out) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    split = lambda text, kind=str: [kind(x) for x in text.split(",") if x]  # noqa: E731
    models, hardware, levels = split(args.models), split(args.hardware), split(args.levels, float)
    started = time.perf_counter()
    graphs = grid.profiled_graphs(models)
    for model in models:
        for hw in hardware:
            grid._GRAPHS[(model, hw)] = grid.retimed(graphs[model], hw)
    tasks = [(model, hw, pp, tp, args.microbatches, levels, args.iterations)
             for model in models for hw in hardware for pp in split(args.pp, int) for tp in split(args.tp, int)]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            outcomes = list(pool.imap(_task, tasks))
    else:
        outcomes = [_task(t) for t in tasks]
    points, skipped = [], 0
    for name, rows in outcomes:
        if isinstance(rows, str):
            skipped += 1
            continue
        points += [{"name": f"{name} L{row['level']:.1f}", **row} for row in rows]
    summary, table = summarise(points, levels)
    summary.append(f"skipped configurations (1F1B's full recomputation does not fit the device, or invalid): {skipped}")
    summary.append(f"wall time: {time.perf_counter() - started:.0f} s")
    print("\n".join(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if argv == [] else "_custom"
    (args.out / f"grid_schedules{suffix}.json").write_text(
        json.dumps({"argv": argv, "summary": summary, "points": points}, indent=1))
    write_markdown(points, table, summary, args.out / f"grid_schedules{suffix}.md", argv)
    print(f"wrote {args.out / f'grid_schedules{suffix}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
