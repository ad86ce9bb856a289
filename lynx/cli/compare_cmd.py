"""`lynx compare` (every solver and baseline on one model, side by side) and `lynx bench search`.

Example::

    $ lynx compare gpt-1.3b --pp 4 --memory-budget 40GiB --json
    $ lynx bench search
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from lynx.cli import app, table_console
from lynx.cli.common import (ATTENTION, DP, DTYPE, HARDWARE, HOST_MEMORY_BUDGET, ITERATIONS, MEMORY_BUDGET,
                             MICROBATCH, MICROBATCHES, MODEL_HELP, OFFLOAD, OPTIMIZER, PP, SCHEDULE, SEED, SEQ,
                             TARGET, TIME_LIMIT, TP, VIRTUAL_STAGES, analyze_spec, apply_sharding, compile_config,
                             run_or_exit)
from lynx.cli.plan_cmd import copy_lane_seconds
from lynx.config import SOLVERS, CompileConfig
from lynx.errors import LynxConfigError, LynxError
from lynx.units import format_size

__all__ = ["compare_command", "bench_search_command", "compare_records", "RECOMPUTE_ONLY_HEU"]

console = Console(stderr=True)

bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


RECOMPUTE_ONLY_HEU = "heu (no offload)"


def compare_records(graph: Any, config: CompileConfig, solvers: tuple[str, ...] = SOLVERS,
                    progress: Any = None, pipeline: Any = None) -> list[dict[str, Any]]:
    """Plan ``graph`` with every solver and baseline under one config; one record each. With
    ``config.offload`` also the offload baselines and recompute-only HEU (``"heu (no offload)"``);
    each record says what each stage offloads per microbatch and how long its copy lanes run."""
    from lynx.planner.loop import plan_graph_outcome

    from lynx.solvers.setup import OFFLOAD_SOLVERS

    records: list[dict[str, Any]] = []
    runs = [(solver, solver, config) for solver in solvers if config.offload or solver not in OFFLOAD_SOLVERS]
    if config.offload and "heu" in solvers:   # recompute-only Lynx beside it
        runs.insert(next(i for i, r in enumerate(runs) if r[0] == "heu") + 1,
                    (RECOMPUTE_ONLY_HEU, "heu", config.replace(offload=False, host_memory_budget=None)))
    for label, solver, cfg in runs:
        try:
            out = plan_graph_outcome(graph, cfg.replace(solver=solver), check_budget=False, progress=progress,
                                     pipeline=pipeline if cfg is config else None)
        except LynxError as err:
            records.append({"solver": label, "status": "ERROR", "error": str(err)})
            continue
        if cfg is config:
            pipeline = out.pipeline
        plan = out.plan
        if plan is None:   # never: plan_graph_outcome assembles a plan unless asked not to
            raise LynxError(f"planning with {solver} assembled no plan")
        p = plan.predicted
        records.append({"solver": label, "status": plan.status, "gap": plan.gap,
                        "step_time_s": p.step_time_s, "exposed_recompute_s": p.exposed_recompute_s,
                        "hidden_recompute_s": p.hidden_recompute_s, "bubble_s": p.bubble_s,
                        "peak_memory_bytes": p.peak_memory_bytes, "fits_budget": p.fits_budget,
                        "search_time_s": plan.search_time_s,
                        "offloaded_bytes": [st.offloaded_bytes for st in plan.stages],
                        "exposed_copy_s": p.exposed_copy_s,
                        "copy_lanes_s": [[lanes.get(k, 0.0) for k in ("d2h", "h2d")] for lanes in (
                            copy_lane_seconds(plan.timeline_detail).get(st.index, {})
                            for st in plan.stages)]})
    full = next((r for r in records if r["solver"] == "full" and "step_time_s" in r), None)
    for r in records:
        if "step_time_s" in r:
            r["speedup_over_full"] = full["step_time_s"] / r["step_time_s"] if full else None
    return records


@app.command("compare")
def compare_command(
    model: str = typer.Argument(..., help=MODEL_HELP),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list of records"),
    pp: int = PP, dp: int = DP, tp: int = TP, microbatches: int = MICROBATCHES, schedule: str = SCHEDULE,
    virtual_stages: int = VIRTUAL_STAGES, memory_budget: Optional[str] = MEMORY_BUDGET, hardware: str = HARDWARE,
    optimizer: str = OPTIMIZER, time_limit: float = TIME_LIMIT, target: Optional[str] = TARGET, seed: int = SEED,
    iterations: int = ITERATIONS, seq: Optional[int] = SEQ, microbatch: Optional[int] = MICROBATCH,
    dtype: Optional[str] = DTYPE, attention: Optional[str] = ATTENTION,
    solver: str = typer.Option("heu", "--solver", help="the solver you mean to use: exit 1 when it finds no plan "
                               "within the budget"),
    offload: bool = OFFLOAD, host_memory_budget: Optional[str] = HOST_MEMORY_BUDGET,
) -> None:
    """Every solver and baseline on MODEL side by side, scored by the same simulator.

    With ``--offload`` the solvers decide offload too, the offload baselines join, and
    recompute-only HEU is listed beside HEU; the table then shows what each stage offloads per
    microbatch and its copy lanes' busy time (device→host / host→device).

    Solvers that fail are listed under the table with their whole message. The exit status
    is 1 when the requested ``--solver`` (default heu) finds no plan, or none within the
    budget for opt, heu and checkmate; 0 otherwise.
    """
    if solver not in SOLVERS:
        typer.echo(f"error: --solver must be one of {', '.join(SOLVERS)}, got {solver!r}", err=True)
        raise typer.Exit(2)

    def work() -> list[dict[str, Any]]:
        config = compile_config(pp, dp, tp, microbatches, schedule, virtual_stages, memory_budget, hardware,
                                optimizer, "heu", time_limit, target, seed, iterations, offload, host_memory_budget)
        with console.status(f"analysing {model} …") as status:
            analysis = analyze_spec(model, config, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention)
            sharded, _sharding = apply_sharding(analysis, config)
            return compare_records(analysis.graph, sharded, progress=lambda msg: status.update(msg))

    records = run_or_exit(work)
    verdict = _requested_verdict(records, solver, memory_budget)
    if as_json:
        print(json.dumps(records, indent=1))
        if verdict:
            typer.echo(f"error: {verdict}", err=True)
            raise typer.Exit(1)
        return
    table = Table(title=f"{model}: pp={pp} tp={tp} dp={dp} m={microbatches} {schedule}, budget {memory_budget}")
    columns = ("solver", "status", "step ms", "speedup vs full", "exposed ms", "hidden ms", "peak per stage",
               "fits", "search s") + (("offloaded per stage", "copy lanes d2h/h2d ms", "copy wait ms")
                                      if offload else ())
    for column in columns:
        table.add_column(column, justify="right")
    for r in records:
        if "step_time_s" not in r:
            table.add_row(r["solver"], "[red]error[/]", "(below)", *[""] * (len(columns) - 3))
            continue
        extra = (" ".join(format_size(b) for b in r["offloaded_bytes"]),
                 " ".join(f"{d * 1e3:.1f}/{h * 1e3:.1f}" for d, h in r["copy_lanes_s"]),
                 f"{r['exposed_copy_s'] * 1e3:.2f}") if offload else ()
        speed = r.get("speedup_over_full")
        table.add_row(r["solver"], r["status"], f"{r['step_time_s'] * 1e3:.2f}",
                      "-" if speed is None else f"{speed:.3f}×",
                      f"{r['exposed_recompute_s'] * 1e3:.2f}", f"{r['hidden_recompute_s'] * 1e3:.2f}",
                      " ".join(format_size(b) for b in r["peak_memory_bytes"]),
                      "yes" if r["fits_budget"] else "[red]no[/]", f"{r['search_time_s']:.3f}", *extra)
    table_console().print(table)
    for r in records:   # whole messages, outside the table (a cell would clip them)
        if "step_time_s" not in r:
            typer.echo(f"{r['solver']}: {r['error']}")
    if verdict:
        typer.echo(f"error: {verdict}", err=True)
        raise typer.Exit(1)


def _requested_verdict(records: list[dict[str, Any]], solver: str, budget: Optional[str]) -> Optional[str]:
    """Why the requested solver has no usable plan, or None when it has one."""
    from lynx.planner.loop import BUDGET_CHECKED_SOLVERS

    record = next((r for r in records if r["solver"] == solver), None)
    if record is None:
        return None
    if "step_time_s" not in record:
        return f"the requested solver {solver} finds no plan (its error is above)"
    if solver in BUDGET_CHECKED_SOLVERS and not record["fits_budget"]:
        return (f"the requested solver {solver} finds no plan within memory_budget {budget}: its best needs "
                + " ".join(format_size(b) for b in record["peak_memory_bytes"]) + " per stage")
    return None


@bench_app.command("search")
def bench_search_command(
    models: str = typer.Option("gpt-1.3b,gpt-2.7b,gpt-6.7b,gpt-13b,gpt-20b", "--models",
                               help="comma-separated presets to time"),
    repeats: int = typer.Option(5, "--repeats", help="HEU timings per model (median reported)"),
    opt_time_limit: float = typer.Option(60.0, "--opt-time-limit", help="seconds per stage for each OPT solve"),
    out: Path = typer.Option(Path("benchmarks/results"), "--out", help="folder for search.md and search.png"),
) -> None:
    """OPT vs HEU search time over the GPT presets (markdown table and plot)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "search_time.py"
    if not script.exists():
        raise LynxConfigError(f"`lynx bench search` runs {script}, which is not there (run from a source checkout)")
    spec = importlib.util.spec_from_file_location("lynx_bench_search_time", script)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    run_or_exit(lambda: module.main(models=models.split(","), repeats=repeats, opt_time_limit=opt_time_limit, out=out))
