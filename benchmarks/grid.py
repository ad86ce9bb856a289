"""The paper-like grid: Lynx (HEU, optionally OPT) against every baseline, one simulator.

Models gpt-1.3b … gpt-20b (each captured and profiled ONCE on the meta device, then re-timed
per hardware), hardware a100-80g and h100-sxm, pp 4 and 8, tp 1/2/4, 8–32 microbatches, and
per configuration budgets from "`none` just fits" down to "only `full` fits":
``budget = full_peak + level · (none_peak − full_peak)`` for each level (peaks are the
largest stage's). Configurations where even `full` exceeds the device's memory are skipped.
The budget-independent baselines (none, full, full-block, selective) are planned once per
configuration and checked against each budget; heu and checkmate (and opt with ``--opt``)
are planned per budget.

Prints, from this one run:
  * violations of "Lynx's best plan is never slower than any baseline that fits";
  * the median speedup of Lynx over `full` at each budget level (bar: ≥ 1.25× at level 0.3);
  * the share of recomputation hidden where, on every stage, the windows serving each
    microbatch have room for that microbatch's recomputation, counting only windows eligible
    for the layers recomputed; the same share over the points where, in addition, memory
    allows prefetching all of it (the values a window recomputes live until their backward) —
    the bar (≥ 90%) as measured here: where memory does not, hiding more means dropping more
    elsewhere, a different trade-off; and the points where only the capacity suffices;
  * with ``--opt``: the largest relative step-time gap of HEU over OPT (bar: ≤ 1%).

    .venv/bin/python benchmarks/grid.py            # 8 microbatches, ~10 min, 2 workers → grid.{md,json}
    .venv/bin/python benchmarks/grid.py --full     # 8 and 32 microbatches, ~25 min → grid_full.{md,json}
    .venv/bin/python benchmarks/grid.py --models gpt-1.3b --pp 4 --tp 1 --microbatches 8 --opt

    .venv/bin/python benchmarks/grid.py --full --offload   # + HEU with offload, offload baselines
                                                         # → grid_offload_full.{md,json}

Other arguments write grid_custom.{md,json} (grid_offload_custom with --offload).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx.planner.loop import plan_graph_outcome  # noqa: E402
from lynx.config import CompileConfig  # noqa: E402
from lynx.units import format_size  # noqa: E402
from lynx.errors import LynxError  # noqa: E402

BASELINES = ("none", "full", "full-block", "selective")
BUDGETED = ("heu", "checkmate")
# with --offload: the offload baselines (planned once per configuration, offload=True) and HEU
# deciding offload with keep and recompute (planned per budget)
OFFLOAD_BASELINES = ("offload-all", "offload-modules")
HEU_OFFLOAD = "heu+offload"


def grid_parser(description: str) -> argparse.ArgumentParser:
    """The grid's axes, shared with ``grid_schedules.py``: models, hardware, pp, tp."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", default="gpt-1.3b,gpt-2.7b,gpt-6.7b,gpt-13b,gpt-20b")
    p.add_argument("--hardware", default="a100-80g,h100-sxm")
    p.add_argument("--pp", default="4,8")
    p.add_argument("--tp", default="1,2,4")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = grid_parser(__doc__.splitlines()[0])
    p.add_argument("--microbatches", default="8")
    p.add_argument("--full", action="store_true",
                   help="the whole grid: 8 and 32 microbatches (~25 min on 2 busy cores) → grid_full.*")
    p.add_argument("--levels", default="1.0,0.3,0.0", help="budget levels between full (0) and none (1)")
    p.add_argument("--iterations", type=int, default=4,
                   help="planning fixed-point rounds at most (it stops earlier once a round gains < 0.1%%; "
                        "with 32 microbatches the windows of neighbouring stages can take 4 rounds to settle)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--opt", action="store_true", help="also plan with OPT (slow) and compare HEU with it")
    p.add_argument("--opt-time-limit", type=float, default=20.0)
    p.add_argument("--checkmate-time-limit", type=float, default=5.0, help="seconds per stage solve")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--offload", action="store_true",
                   help="also HEU with offload (offload=True; the presets' host links: a100-80g PCIe 4.0 x16, "
                        "h100-sxm PCIe 5.0 x16) and the offload baselines → grid_offload{,_full}.{md,json}")
    p.add_argument("--from-json", type=Path, default=None, help="re-summarise a saved grid_*.json (no planning)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args(argv)


def profiled_graphs(models: list[str]) -> dict[str, Any]:
    """Capture and profile each model once (meta device, CUDA target)."""
    from lynx.frontend.analyze import analyze
    from lynx.models import resolve_model

    graphs = {}
    for name in models:
        started = time.perf_counter()
        resolved = resolve_model(name)
        graphs[name] = analyze(resolved.model, resolved.example_inputs, target="cuda", hardware="h100-sxm").graph
        print(f"analysed {name}: {graphs[name].number_of_nodes()} ops in {time.perf_counter() - started:.1f} s",
              flush=True)
    return graphs


def retimed(graph: Any, hardware: str) -> Any:
    """A copy of ``graph`` with forward/backward times for ``hardware``."""
    from lynx.planner.cost import annotate_times
    from lynx.planner.hardware import get_hardware

    copy = graph.copy()
    copy.graph = dict(graph.graph)
    return annotate_times(copy, get_hardware(hardware))


def windows_suffice(outcome: Any) -> bool:
    """Every stage's windows serving each microbatch can take that microbatch's recomputation
    (and something is recomputed): there, Lynx should hide nearly all of it.

    A window serves only the layers it is eligible for (a tensor-parallel collective inside
    layer l's backward serves layers below l; edge blocks only recv windows), so "can take"
    is Hall's condition, checked on the sets that matter: with eligible sets that are
    prefixes of the stage's layers, the hardest set for a given lowest layer x is every
    layer ≥ x plus the edge blocks, served by the windows eligible for some layer ≥ x.
    """
    needed_any = False
    for problem, result in zip(outcome.problems, outcome.results):
        need: dict[int | None, float] = {}
        for n in problem.nodes:
            if n.name in result.assignment.recompute:
                need[n.layer] = need.get(n.layer, 0.0) + n.recompute_s
        if sum(need.values()) <= 0:
            continue
        needed_any = True
        edges = need.get(None, 0.0)
        layers = sorted(layer for layer in need if layer is not None)
        for mb in range(problem.microbatches):
            windows = [w for w in problem.windows if w.microbatch == mb]
            if edges > sum(w.capacity_s for w in windows if w.eligible_layers is None) + 1e-15:
                return False
            for x in layers:
                upper = edges + sum(v for layer, v in need.items() if layer is not None and layer >= x)
                room = sum(w.capacity_s for w in windows
                           if w.eligible_layers is None or any(layer >= x for layer in w.eligible_layers))
                if upper > room + 1e-15:
                    return False
    return needed_any


def memory_suffices(outcome: Any) -> bool:
    """Prefetching everything the plan recomputes, for every microbatch, fits each stage's
    activation budget (predicted peak): the memory to hold what the windows recompute until
    its backward is there too. Where it is not, hiding more means recomputing more."""
    from lynx.solvers.problem import Assignment
    from lynx.solvers.memory import peak_activation_bytes

    for problem, result in zip(outcome.problems, outcome.results):
        first = {}
        for w in problem.windows:
            first.setdefault(w.microbatch, w.id)
        recompute = result.assignment.recompute
        if not recompute:
            continue
        if len(first) < problem.microbatches:
            return False
        everything = Assignment(recompute, {(name, mb): wid for name in recompute for mb, wid in first.items()})
        if peak_activation_bytes(problem, everything) > problem.activation_budget_bytes:
            return False
    return True


def record(outcome: Any) -> dict[str, Any]:
    sim = outcome.sim
    return {"step_time_s": sim.step_time_s, "exposed_s": sim.exposed_recompute_s, "hidden_s": sim.hidden_recompute_s,
            "peak": max(sim.peak_memory_bytes), "peaks": sim.peak_memory_bytes, "status": outcome.status,
            "search_time_s": outcome.search_time_s, "windows_suffice": windows_suffice(outcome),
            "memory_suffices": memory_suffices(outcome)}


def run_point(graph: Any, base: CompileConfig, levels: list[float], with_opt: bool, opt_limit: float,
              checkmate_limit: float = 5.0, device_memory: int | None = None, offload: bool = False
              ) -> list[dict] | str:
    """Every solver at every budget level of one configuration (a string: why it was skipped).
    With ``offload`` also the offload baselines and HEU deciding offload (:data:`HEU_OFFLOAD`)."""
    fixed = {}
    for solver in ("full",) + tuple(b for b in BASELINES if b != "full"):
        out = plan_graph_outcome(graph, base.replace(solver=solver), check_budget=False, pipeline=fixed.get("_pipe"),
                                 assemble=False)
        fixed["_pipe"] = out.pipeline
        fixed[solver] = record(out)
        if solver == "full" and device_memory is not None and fixed["full"]["peak"] > device_memory:
            return f"full recomputation needs {format_size(fixed['full']['peak'])} > device memory"
    pipe = fixed.pop("_pipe")
    pipe_off = None
    if offload:
        for solver in OFFLOAD_BASELINES:
            out = plan_graph_outcome(graph, base.replace(solver=solver, offload=True), check_budget=False,
                                     pipeline=pipe_off, assemble=False)
            pipe_off = out.pipeline
            fixed[solver] = record(out)
    none_peak, full_peak = fixed["none"]["peak"], fixed["full"]["peak"]
    rows = []
    for level in levels:
        budget = int(full_peak + level * (none_peak - full_peak))
        cfg = base.replace(memory_budget=budget)
        row = {"level": level, "budget": budget, "results": {}}
        for solver, rec in fixed.items():
            row["results"][solver] = dict(rec, fits=rec["peak"] <= budget)
        for solver in BUDGETED + (("opt",) if with_opt else ()) + ((HEU_OFFLOAD,) if offload else ()):
            settings: dict[str, Any] = {"solver": solver}
            if solver == HEU_OFFLOAD:
                settings = {"solver": "heu", "offload": True}
            if solver == "opt":
                settings["time_limit_s"] = opt_limit
            if solver == "checkmate":
                settings["time_limit_s"] = checkmate_limit
            try:
                out = plan_graph_outcome(graph, cfg.replace(**settings), check_budget=False,
                                         pipeline=pipe_off if solver == HEU_OFFLOAD else pipe, assemble=False)
                row["results"][solver] = dict(record(out), fits=out.sim.fits_budget)
            except LynxError as err:
                row["results"][solver] = {"error": str(err), "fits": False}
        rows.append(row)
    return rows


_GRAPHS: dict[tuple[str, str], Any] = {}  # filled before the worker processes fork


def _task(task: tuple) -> tuple[str, list[dict] | str]:
    model, hw, pp, tp, m, levels, args = task
    name = f"{model} {hw} pp{pp} tp{tp} m{m}"
    base = CompileConfig(pp=pp, tp=tp, dp=args.dp, microbatches=m, schedule=args.schedule, hardware=hw,
                         optimizer=args.optimizer, solver="heu", memory_budget=2**50,
                         max_iterations=args.iterations)
    started = time.perf_counter()
    try:
        rows = run_point(_GRAPHS[(model, hw)], base, levels, args.opt, args.opt_time_limit, args.checkmate_time_limit,
                         base.hardware_spec().memory_bytes, offload=args.offload)
    except LynxError as err:
        rows = f"invalid: {err}"
    print(f"{name}: {'skipped, ' + rows if isinstance(rows, str) else 'done'} "
          f"({time.perf_counter() - started:.1f} s)", flush=True)
    return name, rows


LYNX = ("heu", "opt", HEU_OFFLOAD)


def lynx_best(results: dict[str, Any]) -> dict[str, Any] | None:
    fitting = [results[s] for s in LYNX if s in results and results[s].get("fits")]
    return min(fitting, key=lambda r: r["step_time_s"]) if fitting else None


def offload_lines(points: list[dict], levels: list[float]) -> list[str]:
    """HEU with offload against the no-recompute step (`none`'s, fitting or not), beside
    recompute-only HEU; violations of HEU with offload against every fitting baseline."""
    lines, violations = [], []
    ratios: dict[str, dict[float, list[float]]] = {"heu": {lv: [] for lv in levels},
                                                   HEU_OFFLOAD: {lv: [] for lv in levels}}
    for pt in points:
        res = pt["results"]
        off = res.get(HEU_OFFLOAD, {})
        fitting = {s: r for s, r in res.items() if s not in LYNX and r.get("fits")}
        if not off.get("fits"):
            if fitting:
                violations.append(f"{pt['name']}: HEU with offload found no fitting plan; {', '.join(fitting)} fit")
            continue
        for s, r in fitting.items():
            if off["step_time_s"] > r["step_time_s"] * (1 + 1e-9):
                violations.append(f"{pt['name']}: HEU with offload {off['step_time_s'] * 1e3:.3f} ms slower than "
                                  f"{s} {r['step_time_s'] * 1e3:.3f} ms")
        for solver in ratios:
            if res.get(solver, {}).get("fits"):
                ratios[solver][pt["level"]].append(res[solver]["step_time_s"] / res["none"]["step_time_s"])
    lines.append(f"HEU with offload never slower than a fitting baseline (offload ones included): "
                 f"{'YES' if not violations else 'NO'} ({len(violations)} violation(s))")
    lines += [f"  {v}" for v in violations[:20]]
    for lv in levels:
        cells = []
        for solver, label in ((HEU_OFFLOAD, "HEU with offload"), ("heu", "recompute-only HEU")):
            xs = ratios[solver][lv]
            if xs:
                cells.append(f"{label} median {statistics.median(xs):.4f}× (max {max(xs):.4f}×, {len(xs)} points)")
        if cells:
            lines.append(f"level {lv:.1f}: step / no-recompute step: " + "; ".join(cells))
    for s in OFFLOAD_BASELINES:
        fits = [pt for pt in points if pt["results"].get(s, {}).get("fits")]
        if fits:
            xs = [pt["results"][s]["step_time_s"] / pt["results"]["none"]["step_time_s"] for pt in fits]
            lines.append(f"{s}: fits {len(fits)} of {len(points)} points, step / no-recompute step median "
                         f"{statistics.median(xs):.4f}× (max {max(xs):.4f}×)")
        else:
            lines.append(f"{s}: fits none of {len(points)} points")
    return lines


def summarise(points: list[dict], levels: list[float], with_opt: bool) -> list[str]:
    lines, violations, by_level, hidden, gaps = [], [], {lv: [] for lv in levels}, [], []
    hidden_memory: list[float] = []
    memory_bound: list[tuple[float, dict]] = []
    for pt in points:
        res = pt["results"]
        best = lynx_best(res)
        fitting = {s: r for s, r in res.items() if s not in LYNX and r.get("fits")}
        if best is None:
            if fitting:
                why = res.get("heu", {}).get("error", "its plan does not fit")
                violations.append(f"{pt['name']}: Lynx found no fitting plan ({why[:110]}); {', '.join(fitting)} fit")
            continue
        for s, r in fitting.items():
            if best["step_time_s"] > r["step_time_s"] * (1 + 1e-9):
                violations.append(f"{pt['name']}: Lynx {best['step_time_s'] * 1e3:.3f} ms slower than "
                                  f"{s} {r['step_time_s'] * 1e3:.3f} ms")
        by_level[pt["level"]].append(res["full"]["step_time_s"] / best["step_time_s"])
        if best["windows_suffice"]:
            hidden.append(best["hidden_s"] / (best["hidden_s"] + best["exposed_s"]))
            if best.get("memory_suffices"):
                hidden_memory.append(hidden[-1])
            else:
                memory_bound.append((hidden[-1], pt))
        if with_opt and res.get("opt", {}).get("fits") and res["heu"].get("fits"):
            gaps.append(res["heu"]["step_time_s"] / res["opt"]["step_time_s"] - 1)
    errors = sum(1 for pt in points if "error" in pt["results"].get("heu", {}))
    lines.append(f"grid points: {len(points)} (HEU raised an error on {errors})")
    lines.append(f"Lynx never slower than a fitting baseline: {'YES' if not violations else 'NO'} "
                 f"({len(violations)} violation(s))")
    slower = [v for v in violations if "slower than" in v]
    if slower:
        worst = max(float(v.split("Lynx ")[1].split(" ms")[0]) / float(v.split(" ms")[-2].split()[-1]) - 1
                    for v in slower)
        lines.append(
            f"  {len(slower)} where HEU's plan is slower than a fitting baseline (worst by {worst:.2%}), "
            f"{len(violations) - len(slower)} where HEU found no fitting plan"
        )
    lines += [f"  {v}" for v in violations[:20]]
    for lv in levels:
        xs = by_level[lv]
        if xs:
            lines.append(
                f"level {lv:.1f}: median speedup over full {statistics.median(xs):.3f}× "
                f"(min {min(xs):.3f}×, max {max(xs):.3f}×, {len(xs)} points)"
            )
    if hidden:
        lines.append(
            f"hidden share where the eligible windows' capacity covers the recompute (Hall's condition): "
            f"median {statistics.median(hidden):.1%}, min {min(hidden):.1%} over {len(hidden)} points"
        )
    else:
        lines.append("hidden share where windows suffice: no grid point where the windows cover the recompute")
    if hidden_memory:
        lines.append(
            f"  … and memory admits prefetching all of it (capacity AND memory: the bar's condition as "
            f"measured): median {statistics.median(hidden_memory):.1%}, min {min(hidden_memory):.1%} "
            f"over {len(hidden_memory)} points"
        )
    bound = [(h, pt["name"]) for h, pt in memory_bound]
    if bound:
        lines.append(
            f"  … capacity suffices but memory does not ({len(bound)} points; a prefetched value lives "
            f"until its backward, so hiding more means dropping more elsewhere): min "
            f"{min(bound)[0]:.1%} at {min(bound)[1]}"
        )
    if gaps:
        lines.append(
            f"HEU vs OPT step time: max gap {max(gaps):+.3%}, median {statistics.median(gaps):+.3%} "
            f"over {len(gaps)} points"
        )
    if any(HEU_OFFLOAD in pt["results"] for pt in points):
        lines += offload_lines(points, levels)
    return lines


def write_markdown(points: list[dict], summary: list[str], path: Path, argv: list[str]) -> None:
    solvers = ["heu", "opt", "checkmate", "none", "full", "full-block", "selective"]
    if any(HEU_OFFLOAD in pt["results"] for pt in points):
        solvers = [HEU_OFFLOAD, *solvers, *OFFLOAD_BASELINES]
    out = [
        "# Lynx grid: step time per solver (ms), simulated; `-` = does not fit the budget",
        "",
        f"Command: `.venv/bin/python benchmarks/grid.py {' '.join(argv)}`",
        "",
        "```",
        *summary,
        "```",
        "",
        "| point | budget | " + " | ".join(solvers) + " | speedup vs full | hidden |",
        "|---|---|" + "---|" * len(solvers) + "---|---|",
    ]
    for pt in points:
        res, best = pt["results"], lynx_best(pt["results"])
        cells = []
        for s in solvers:
            r = res.get(s)
            cells.append("" if r is None else ("-" if not r.get("fits") else f"{r['step_time_s'] * 1e3:.1f}"))
        speed = f"{res['full']['step_time_s'] / best['step_time_s']:.3f}×" if best else "-"
        hid = (
            f"{best['hidden_s'] / (best['hidden_s'] + best['exposed_s']):.0%}"
            if best and best["hidden_s"] + best["exposed_s"] > 0
            else "-"
        )
        out.append(f"| {pt['name']} | {format_size(pt['budget'])} | " + " | ".join(cells) + f" | {speed} | {hid} |")
    path.write_text("\n".join(out) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.full:
        args.microbatches = "8,32"
    split = lambda text, kind=str: [kind(x) for x in text.split(",") if x]  # noqa: E731
    models, hardware, levels = split(args.models), split(args.hardware), split(args.levels, float)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        points = saved["points"]
        levels = sorted({pt["level"] for pt in points}, reverse=True)
        summary = summarise(points, levels, any("opt" in pt["results"] for pt in points))
        summary += [line for line in saved["summary"] if line.startswith(("skipped", "wall time"))]
        print("\n".join(summary))
        write_markdown(points, summary, args.from_json.with_suffix(".md"), saved.get("argv_note", saved["argv"]))
        return 0
    started = time.perf_counter()
    graphs = profiled_graphs(models)
    for model in models:
        for hw in hardware:
            _GRAPHS[(model, hw)] = retimed(graphs[model], hw)
    tasks = [
        (model, hw, pp, tp, m, levels, args)
        for model in models
        for hw in hardware
        for pp in split(args.pp, int)
        for tp in split(args.tp, int)
        for m in split(args.microbatches, int)
    ]
    points, skipped = [], 0
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            outcomes = list(pool.imap(_task, tasks))
    else:
        outcomes = [_task(t) for t in tasks]
    for name, rows in outcomes:
        if isinstance(rows, str):
            skipped += 1
            continue
        points += [{"name": f"{name} L{row['level']:.1f}", **row} for row in rows]
    summary = summarise(points, levels, args.opt)
    summary.append(f"skipped configurations (full does not fit the device, or invalid): {skipped}")
    summary.append(f"wall time: {time.perf_counter() - started:.0f} s")
    print("\n".join(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    plain = [a for a in argv if a != "--offload"]
    suffix = "" if plain == [] else "_full" if plain == ["--full"] else "_custom"
    if args.offload:
        suffix = "_offload" + suffix
    (args.out / f"grid{suffix}.json").write_text(
        json.dumps({"argv": argv, "summary": summary, "points": points}, indent=1)
    )
    write_markdown(points, summary, args.out / f"grid{suffix}.md", argv)
    print(f"wrote {args.out / f'grid{suffix}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
