"""`lynx plan` and `lynx show` (`lynx compare`: :mod:`lynx.cli.compare_cmd`).

Example::

    $ lynx plan gpt-1.3b --pp 4 --microbatches 8 --memory-budget 40GiB -o plan.json
    $ lynx show plan.json                 # table per stage + plan.timeline.png / .svg
"""

from __future__ import annotations

import os
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
from lynx.config import SOLVERS, CompileConfig
from lynx.errors import LynxError
from lynx.units import format_size

__all__ = ["plan_command", "show_command", "schedule_name", "copy_lane_seconds"]

console = Console(stderr=True)


@app.command("plan")
def plan_command(
    model: str = typer.Argument(..., help=MODEL_HELP),
    output: Path = typer.Option(Path("plan.json"), "--output", "-o", help="where to write the plan"),
    solver: str = typer.Option("heu", "--solver", help=" | ".join(SOLVERS)),
    pp: int = PP, dp: int = DP, tp: int = TP, microbatches: int = MICROBATCHES, schedule: str = SCHEDULE,
    virtual_stages: int = VIRTUAL_STAGES, memory_budget: Optional[str] = MEMORY_BUDGET, hardware: str = HARDWARE,
    optimizer: str = OPTIMIZER, time_limit: float = TIME_LIMIT, target: Optional[str] = TARGET, seed: int = SEED,
    iterations: int = ITERATIONS, seq: Optional[int] = SEQ, microbatch: Optional[int] = MICROBATCH,
    dtype: Optional[str] = DTYPE, attention: Optional[str] = ATTENTION,
    compile_graphs: bool = typer.Option(False, "--compile", help="runs of this plan pass each stage's generated "
                                        "graphs through torch.compile (Inductor; on CPU it needs gcc/clang)"),
    offload: bool = OFFLOAD, host_memory_budget: Optional[str] = HOST_MEMORY_BUDGET,
) -> None:
    """Plan recomputation for MODEL and write the plan as JSON; print the seconds of each phase."""
    from lynx.phases import Phases, since_process_start
    from lynx.planner.loop import plan_graph_outcome

    startup = since_process_start()

    def work() -> Any:
        config = compile_config(pp, dp, tp, microbatches, schedule, virtual_stages, memory_budget, hardware,
                                optimizer, solver, time_limit, target, seed, iterations, offload,
                                host_memory_budget).replace(compile=compile_graphs)
        config = _shared_cores(config) if hardware == "auto" else config
        with console.status(f"analysing {model} …") as status:
            analysis = analyze_spec(model, config, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention)
            config, _sharding = apply_sharding(analysis, config)   # tp > 1: the default sharding, recorded
            outcome = plan_graph_outcome(analysis.graph, config, progress=lambda msg: status.update(msg))
        phases = Phases() if startup is None else Phases(startup=startup)
        phases.update_from(analysis.phases).update_from(outcome.phases)
        plan = outcome.plan
        if plan is None:   # never: plan_graph_outcome assembles a plan unless asked not to
            raise LynxError("planning assembled no plan")
        with phases.timed("write"):
            plan.save(output)
        return plan, phases, _sharding, config

    plan, phases, sharding, used = run_or_exit(work)
    _summary(plan)
    if sharding is not None:
        console.print(_tp_line(sharding, used), soft_wrap=True)
    console.print(f"wrote {output}")
    console.print(f"phases: {phases.format()}", soft_wrap=True)


def _shared_cores(config: CompileConfig) -> CompileConfig:
    """``auto`` is this machine with a core per rank: where the mesh has more ranks than this
    machine has cores, the cores shared among the ranks busy at each instant (as
    ``examples/train_gpt.py`` plans, :func:`lynx.planner.hardware.share_cores`), said on stderr."""
    from lynx.planner.hardware import share_cores

    spec = config.hardware_spec()
    ranks = config.pp * config.tp * config.dp
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shared = share_cores(spec, ranks, cores)
    if shared is spec:
        return config
    typer.echo(f"hardware auto: {ranks} ranks (pp {config.pp} × tp {config.tp} × dp {config.dp}) on this machine's "
               f"{cores} cores: planned with the cores shared among the busy ranks ({cores}/{ranks} of a core each "
               f"while all run; {shared.name})", err=True)
    return config.replace(hardware=shared)


def _tp_line(sharding: Any, config: CompileConfig) -> str:
    """What one TP rank's layer communicates, as the plan prices it (the first layer's collectives)."""
    from lynx.planner.comm import CommModel

    comm = CommModel.from_hardware(config.hardware_spec(), tp=config.tp, dp=config.dp, optimizer=config.optimizer)
    layer = next((k for k in sorted(k for k in sharding.collectives if k is not None)), None)
    if layer is None:
        return f"tp {config.tp}: no collectives in the layers"
    fw, bw = sharding.collectives[layer]["forward"], sharding.collectives[layer]["backward"]
    each = ", ".join(f"{format_size(b)} {comm.tp_allreduce(b) * 1e3:.3f} ms" for b in fw)
    return (f"tp {config.tp}: per layer {len(fw)} forward and {len(bw)} backward all-reduces ({each} each on the tp "
            f"link); sharding {sharding.record()}")


def _blocks(names: list[str]) -> str:
    """``["pre", "layers.0", "layers.1"]`` -> ``"pre,0-1"``: a chunk's blocks, short."""
    layers = [int(n.split(".")[-1]) for n in names if n.startswith("layers.")]
    parts = [n for n in names if not n.startswith("layers.") and names.index(n) == 0]
    if layers:
        parts.append(str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}")
    parts += [n for n in names if not n.startswith("layers.") and names.index(n) > 0]
    return ",".join(parts)


def schedule_name(plan: Any) -> str:
    """The plan's schedule as people name it: ``1f1b``, ``zbh1``, ``interleaved1f1b (2 chunks per device)``."""
    schedule = str(plan.config.get("schedule", "1f1b"))
    if schedule == "interleaved1f1b":
        return f"{schedule} ({plan.config.get('virtual_stages', 2)} chunks per device)"
    return schedule


def _summary(plan: Any) -> None:
    p = plan.predicted
    console.print(soft_wrap=True, *[
        f"[bold]{plan.solver}[/] ({plan.status}{'' if plan.gap is None else f', gap {plan.gap:.2%}'}), "
        f"{schedule_name(plan)}: "
        f"step {p.step_time_s * 1e3:.2f} ms, exposed recompute {p.exposed_recompute_s * 1e3:.2f} ms, "
        f"hidden {p.hidden_recompute_s * 1e3:.2f} ms, bubble {p.bubble_s * 1e3:.2f} ms, "
        f"peak {', '.join(format_size(b) for b in p.peak_memory_bytes)}, "
        f"{'fits' if p.fits_budget else '[red]does NOT fit[/]'} the budget; search {plan.search_time_s:.3f} s"])
    if any(d.action == "offload" for st in plan.stages for d in st.decisions):
        console.print(soft_wrap=True, *[
            "offloaded to host memory per microbatch: " + ", ".join(
                f"stage {st.index} {format_size(st.offloaded_bytes)}" for st in plan.stages)
            + f"; backwards waiting on prefetches {p.exposed_copy_s * 1e3:.2f} ms"])


@app.command("show")
def show_command(
    plan_path: Path = typer.Argument(..., help="a plan written by `lynx plan`"),
    picture: Optional[Path] = typer.Option(None, "--picture", help="timeline picture path (.png and .svg written)"),
    model: Optional[str] = typer.Option(None, "--model", help="re-check the plan against this model (as planned: "
                                        "with --seq, --microbatch, --dtype, --attention) before showing it"),
    seq: Optional[int] = SEQ, microbatch: Optional[int] = MICROBATCH, dtype: Optional[str] = DTYPE,
    attention: Optional[str] = ATTENTION,
) -> None:
    """Print a plan per stage and draw its timeline (compute, recompute, communication, idle).

    The figures are those the file records; with ``--model`` the plan is first re-checked as
    ``lynx.compile(plan=...)`` does (fingerprint, records and predictions replayed from its
    decisions) and refused, naming the stage and field, when they disagree.
    """
    from lynx.plan import Plan
    from lynx.viz import draw_timeline, stage_totals

    plan = run_or_exit(lambda: Plan.load(plan_path))
    if model is not None:
        run_or_exit(lambda: _recheck(plan, model, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention))
    totals = stage_totals(plan.timeline, plan.predicted.step_time_s)
    schedule = schedule_name(plan)
    table = Table(title=f"{plan_path} — {plan.solver}, {schedule}, pp={plan.config.get('pp')}, "
                        f"m={plan.config.get('microbatches')}")
    several = any(len(stage.chunks) > 1 for stage in plan.stages)   # a chunks column only where it says more
    offloads = any(d.action == "offload" for st in plan.stages for d in st.decisions)
    copy_s = copy_lane_seconds(plan.timeline_detail) if offloads else {}
    for column in ("stage", "layers", *(("chunks",) if several else ()), "in flight", "kept", "in windows",
                   "on demand", "static", "activations", "peak", "budget", "fits", "compute ms", "recompute ms",
                   "hidden ms", "exposed ms", "runtime ms", "comm ms", "idle ms",
                   *(("offloaded", "offloaded bytes", "host", "d2h ms", "h2d ms", "copy wait ms") if offloads else ())):
        table.add_column(column, justify="right")
    for stage in plan.stages:
        kept = sum(d.action == "keep" for d in stage.decisions)
        moved = sum(d.action == "offload" for d in stage.decisions)
        windowed = sum(d.action == "recompute" and (d.window or d.windows) is not None for d in stage.decisions)
        on_demand = len(stage.decisions) - kept - windowed - moved
        lanes = copy_s.get(stage.index, {})
        extra = (str(moved), format_size(stage.offloaded_bytes), format_size(stage.host_bytes),
                 f"{lanes.get('d2h', 0.0) * 1e3:.2f}", f"{lanes.get('h2d', 0.0) * 1e3:.2f}",
                 f"{stage.exposed_copy_s * 1e3:.2f}") if offloads else ()
        t = totals.get(stage.index, {})
        layers = f"{stage.layers[0]}–{stage.layers[-1]}" if stage.layers else "-"
        chunks = " ".join(f"c{c.index}({_blocks(c.blocks)})" for c in stage.chunks) or "-"
        table.add_row(str(stage.index), layers, *((chunks,) if several else ()), str(stage.in_flight), str(kept),
                      str(windowed), str(on_demand),
                      format_size(stage.static_bytes), format_size(stage.activation_bytes),
                      format_size(stage.peak_memory_bytes), format_size(stage.budget_bytes),
                      "yes" if stage.peak_memory_bytes <= stage.budget_bytes else "[red]no[/]",
                      f"{t.get('compute', 0.0) * 1e3:.2f}", f"{t.get('recompute', 0.0) * 1e3:.2f}",
                      f"{stage.hidden_recompute_s * 1e3:.2f}", f"{stage.exposed_recompute_s * 1e3:.2f}",
                      *(f"{t.get(k, 0.0) * 1e3:.2f}" for k in ("runtime", "comm", "idle")), *extra)
    table_console().print(table)
    _summary(plan)
    console.print(f"re-checked against {model}: its decisions replay to these figures" if model is not None else
                  "figures as the file records them (not re-checked: --model MODEL replays its decisions)")
    target = picture or plan_path.parent / (plan_path.stem + ".timeline")
    written = draw_timeline(plan.timeline, plan.predicted.step_time_s, target, detail=plan.timeline_detail,
                            title=f"{plan.solver}, {schedule}: step {plan.predicted.step_time_s * 1e3:.2f} ms")
    console.print("timeline picture: " + ", ".join(str(p) for p in written))


def copy_lane_seconds(detail: Any) -> dict[int, dict[str, float]]:
    """Per stage, seconds its host link's copy lanes are busy (``d2h``, ``h2d``) in the step."""
    out: dict[int, dict[str, float]] = {}
    for stage, kind, start, end, _label in detail or ():
        if kind in ("d2h", "h2d"):
            lanes = out.setdefault(stage, {})
            lanes[kind] = lanes.get(kind, 0.0) + end - start
    return out


def _recheck(plan: Any, model: str, **dims: Any) -> None:
    """What ``lynx.compile(plan=...)`` checks, against ``model`` analysed as the plan's config says."""
    from lynx.plan import check_fingerprint
    from lynx.planner.fingerprint import graph_fingerprint
    from lynx.planner.plan_check import recheck_plan
    from lynx.planner.simulator import config_from_record

    config = config_from_record(plan.config)
    analysis = analyze_spec(model, config, **dims)
    check_fingerprint(plan, graph_fingerprint(analysis.graph), config.fingerprint_fields())
    recheck_plan(plan, analysis.graph)
