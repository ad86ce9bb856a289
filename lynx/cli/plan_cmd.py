"""`lynx plan`, `lynx show`, `lynx compare` and `lynx bench search`.

Example::

    $ lynx plan gpt-1.3b --pp 4 --microbatches 8 --memory-budget 40GiB -o plan.json
    $ lynx show plan.json                 # table per stage + plan.timeline.png / .svg
    $ lynx compare gpt-1.3b --pp 4 --memory-budget 40GiB --json
    $ lynx bench search
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from lynx.cli import app, table_console
from lynx.config import SOLVERS, CompileConfig
from lynx.units import format_size
from lynx.errors import LynxConfigError, LynxError

__all__ = ["plan_command", "show_command", "schedule_name", "compare_command", "bench_search_command",
           "compare_records",
           "analyze_spec"]

console = Console(stderr=True)


bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

MODEL_HELP = "a preset (gpt-1.3b … gpt-20b, llama-7b, gpt-tiny, llama-tiny) or module:factory"


def _config(pp: int, dp: int, tp: int, microbatches: int, schedule: str, virtual_stages: int,
            memory_budget: Optional[str], hardware: str, optimizer: str, solver: str, time_limit: float,
            target: Optional[str], seed: int, iterations: int, offload: bool = False,
            host_memory_budget: Optional[str] = None) -> CompileConfig:
    budget: Any = memory_budget
    if memory_budget is not None and memory_budget.isdigit():
        budget = int(memory_budget)
    host: Any = host_memory_budget
    if host_memory_budget is not None and host_memory_budget.isdigit():
        host = int(host_memory_budget)
    return CompileConfig(pp=pp, dp=dp, tp=tp, microbatches=microbatches, schedule=schedule,
                         virtual_stages=virtual_stages, memory_budget=budget, hardware=hardware,
                         optimizer=optimizer, solver=solver, time_limit_s=time_limit, target=target,
                         seed=seed, max_iterations=iterations, offload=offload, host_memory_budget=host)


def apply_sharding(analysis: Any, config: CompileConfig) -> tuple[CompileConfig, Any]:
    """:func:`lynx.frontend.tp_profile.apply_sharding`: with tp > 1 the default sharding plan,
    marked on the graph and recorded in the config (a plan then runs as it was priced)."""
    from lynx.frontend.tp_profile import apply_sharding as shard

    return shard(analysis, config)


def analyze_spec(model: str, config: CompileConfig, *, seq: Optional[int] = None, microbatch: Optional[int] = None,
                 dtype: Optional[str] = None, attention: Optional[str] = None) -> Any:
    """Resolve ``model`` (preset or module:factory) on the meta device and analyse it (the
    analysis's ``phases`` add ``import`` and ``model``: see :mod:`lynx.phases`)."""
    from lynx.frontend.analyze import analyze
    from lynx.models import resolve_model
    from lynx.phases import Phases

    phases = Phases()
    with phases.timed("import"):  # capture needs it, and building a model on meta would import it unnamed
        from lynx.torch_private import import_tracer

        import_tracer()
        gc.freeze()  # what the imports made lives to the end: later collections need not scan it
    with phases.timed("model"):
        resolved = resolve_model(model, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention)
    analysis = analyze(resolved.model, resolved.example_inputs, target=config.target, hardware=config.hardware_spec())
    analysis.phases = phases.update_from(analysis.phases)
    return analysis


def _run(fn: Any) -> Any:
    try:
        return fn()
    except LynxError as err:
        typer.echo(f"error: {err}", err=True)  # plain: a message must not be re-wrapped
        raise typer.Exit(2) from None


# Options shared by plan and compare (typer needs them spelled out per command).
_PP = typer.Option(1, "--pp", help="pipeline stages")
_DP = typer.Option(1, "--dp", help="data-parallel replicas")
_TP = typer.Option(1, "--tp", help="tensor-parallel degree")
_M = typer.Option(8, "--microbatches", "-m", help="microbatches per step")
_SCHED = typer.Option("1f1b", "--schedule", help="1f1b | gpipe | interleaved1f1b | zbh1")
_VIRT = typer.Option(2, "--virtual-stages", help="model chunks per device (interleaved1f1b)")
_BUDGET = typer.Option(None, "--memory-budget", "-b", help="per device, e.g. 60GiB (default: device memory)")
_HW = typer.Option("h100-sxm", "--hardware", help="a preset (cpu-local, h100-sxm, a100-25gbe, ...), "
                   "a hardware file (.yaml/.json) or auto (this machine, measured)")
_OPTIM = typer.Option("adamw", "--optimizer", help="adamw | demo | lion (sets the DP windows)")
_TL = typer.Option(60.0, "--time-limit", help="seconds per stage solve (opt)")
_TARGET = typer.Option(None, "--target", help="cuda | cpu (default from the hardware)")
_SEED = typer.Option(0, "--seed",
                     help="recorded in the plan's config (the solvers are deterministic and do not read it)")
_ITER = typer.Option(3, "--iterations", help="re-derive windows and re-solve at most this often")
_SEQ = typer.Option(None, "--seq", help="sequence length (presets)")
_MB = typer.Option(None, "--microbatch", help="microbatch size (presets)")
_DTYPE = typer.Option(None, "--dtype", help="fp16 | bf16 | fp32")
_ATTN = typer.Option(None, "--attention", help="math | sdpa (presets)")
_OFFLOAD = typer.Option(False, "--offload", help="also decide offload: saved values copied to host memory and "
                        "back over the hardware's host link (a fourth choice beside keep and recompute)")
_HOST_BUDGET = typer.Option(None, "--host-memory-budget", help="pinned host memory offload may fill per device, "
                            "e.g. 64GiB (default: the hardware's host_memory_bytes)")


@app.command("plan")
def plan_command(
    model: str = typer.Argument(..., help=MODEL_HELP),
    output: Path = typer.Option(Path("plan.json"), "--output", "-o", help="where to write the plan"),
    solver: str = typer.Option("heu", "--solver", help=" | ".join(SOLVERS)),
    pp: int = _PP, dp: int = _DP, tp: int = _TP, microbatches: int = _M, schedule: str = _SCHED,
    virtual_stages: int = _VIRT, memory_budget: Optional[str] = _BUDGET, hardware: str = _HW,
    optimizer: str = _OPTIM, time_limit: float = _TL, target: Optional[str] = _TARGET, seed: int = _SEED,
    iterations: int = _ITER, seq: Optional[int] = _SEQ, microbatch: Optional[int] = _MB,
    dtype: Optional[str] = _DTYPE, attention: Optional[str] = _ATTN,
    compile_graphs: bool = typer.Option(False, "--compile", help="runs of this plan pass each stage's generated "
                                        "graphs through torch.compile (Inductor; on CPU it needs gcc/clang)"),
    offload: bool = _OFFLOAD, host_memory_budget: Optional[str] = _HOST_BUDGET,
) -> None:
    """Plan recomputation for MODEL and write the plan as JSON; print the seconds of each phase."""
    from lynx.phases import Phases, since_process_start
    from lynx.planner.loop import plan_graph_outcome

    startup = since_process_start()

    def work() -> Any:
        config = _config(pp, dp, tp, microbatches, schedule, virtual_stages, memory_budget, hardware, optimizer,
                         solver, time_limit, target, seed, iterations, offload,
                         host_memory_budget).replace(compile=compile_graphs)
        config = _shared_cores(config) if hardware == "auto" else config
        with console.status(f"analysing {model} …") as status:
            analysis = analyze_spec(model, config, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention)
            config, _sharding = apply_sharding(analysis, config)   # tp > 1: the default sharding, recorded
            outcome = plan_graph_outcome(analysis.graph, config, progress=lambda msg: status.update(msg))
        phases = Phases() if startup is None else Phases(startup=startup)
        phases.update_from(analysis.phases).update_from(outcome.phases)
        with phases.timed("write"):
            outcome.plan.save(output)
        return outcome.plan, phases, _sharding, config

    plan, phases, sharding, used = _run(work)
    _summary(plan)
    if sharding is not None:
        console.print(_tp_line(sharding, used), soft_wrap=True)
    console.print(f"wrote {output}")
    console.print(f"phases: {phases.format()}", soft_wrap=True)


def _shared_cores(config: CompileConfig) -> CompileConfig:
    """``auto`` is this machine with a core per rank: where the mesh has more ranks than this
    machine has cores, each rank's share of one (as ``examples/train_gpt.py`` plans,
    :func:`lynx.planner.hardware.share_cores`), said on stderr."""
    from lynx.planner.hardware import share_cores

    spec = config.hardware_spec()
    ranks = config.pp * config.tp * config.dp
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shared = share_cores(spec, ranks, cores)
    if shared is spec:
        return config
    typer.echo(f"hardware auto: {ranks} ranks (pp {config.pp} × tp {config.tp} × dp {config.dp}) on this machine's "
               f"{cores} cores: planned with each rank on {cores}/{ranks} of a core ({shared.name})", err=True)
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
    seq: Optional[int] = _SEQ, microbatch: Optional[int] = _MB, dtype: Optional[str] = _DTYPE,
    attention: Optional[str] = _ATTN,
) -> None:
    """Print a plan per stage and draw its timeline (compute, recompute, communication, idle).

    The figures are those the file records; with ``--model`` the plan is first re-checked as
    ``lynx.compile(plan=...)`` does (fingerprint, records and predictions replayed from its
    decisions) and refused, naming the stage and field, when they disagree.
    """
    from lynx.plan import Plan
    from lynx.viz import draw_timeline, stage_totals

    plan = _run(lambda: Plan.load(plan_path))
    if model is not None:
        _run(lambda: _recheck(plan, model, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention))
    totals = stage_totals(plan.timeline, plan.predicted.step_time_s)
    schedule = schedule_name(plan)
    table = Table(title=f"{plan_path} — {plan.solver}, {schedule}, pp={plan.config.get('pp')}, "
                        f"m={plan.config.get('microbatches')}")
    several = any(len(stage.chunks) > 1 for stage in plan.stages)   # a chunks column only where it says more
    offloads = any(d.action == "offload" for st in plan.stages for d in st.decisions)
    copy_s = _copy_lane_seconds(plan.timeline_detail) if offloads else {}
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


def _copy_lane_seconds(detail: Any) -> dict[int, dict[str, float]]:
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


RECOMPUTE_ONLY_HEU = "heu (no offload)"


def compare_records(graph: Any, config: CompileConfig, solvers: tuple[str, ...] = SOLVERS,
                    progress: Any = None, pipeline: Any = None) -> list[dict[str, Any]]:
    """Plan ``graph`` with every solver and baseline under one config; one record each. With
    ``config.offload`` also the offload baselines and recompute-only HEU (``"heu (no offload)"``);
    each record says what each stage offloads per microbatch and how long its copy lanes run."""
    from lynx.planner.loop import plan_graph_outcome

    from lynx.solvers.setup import OFFLOAD_SOLVERS

    records = []
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
        p = out.plan.predicted
        records.append({"solver": label, "status": out.plan.status, "gap": out.plan.gap,
                        "step_time_s": p.step_time_s, "exposed_recompute_s": p.exposed_recompute_s,
                        "hidden_recompute_s": p.hidden_recompute_s, "bubble_s": p.bubble_s,
                        "peak_memory_bytes": p.peak_memory_bytes, "fits_budget": p.fits_budget,
                        "search_time_s": out.plan.search_time_s,
                        "offloaded_bytes": [st.offloaded_bytes for st in out.plan.stages],
                        "exposed_copy_s": p.exposed_copy_s,
                        "copy_lanes_s": [[lanes.get(k, 0.0) for k in ("d2h", "h2d")] for lanes in (
                            _copy_lane_seconds(out.plan.timeline_detail).get(st.index, {})
                            for st in out.plan.stages)]})
    full = next((r for r in records if r["solver"] == "full" and "step_time_s" in r), None)
    for r in records:
        if "step_time_s" in r:
            r["speedup_over_full"] = full["step_time_s"] / r["step_time_s"] if full else None
    return records


@app.command("compare")
def compare_command(
    model: str = typer.Argument(..., help=MODEL_HELP),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list of records"),
    pp: int = _PP, dp: int = _DP, tp: int = _TP, microbatches: int = _M, schedule: str = _SCHED,
    virtual_stages: int = _VIRT, memory_budget: Optional[str] = _BUDGET, hardware: str = _HW,
    optimizer: str = _OPTIM, time_limit: float = _TL, target: Optional[str] = _TARGET, seed: int = _SEED,
    iterations: int = _ITER, seq: Optional[int] = _SEQ, microbatch: Optional[int] = _MB,
    dtype: Optional[str] = _DTYPE, attention: Optional[str] = _ATTN,
    solver: str = typer.Option("heu", "--solver", help="the solver you mean to use: exit 1 when it finds no plan "
                               "within the budget"),
    offload: bool = _OFFLOAD, host_memory_budget: Optional[str] = _HOST_BUDGET,
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
        config = _config(pp, dp, tp, microbatches, schedule, virtual_stages, memory_budget, hardware, optimizer,
                         "heu", time_limit, target, seed, iterations, offload, host_memory_budget)
        with console.status(f"analysing {model} …") as status:
            analysis = analyze_spec(model, config, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention)
            sharded, _sharding = apply_sharding(analysis, config)
            return compare_records(analysis.graph, sharded, progress=lambda msg: status.update(msg))

    records = _run(work)
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
    _run(lambda: module.main(models=models.split(","), repeats=repeats, opt_time_limit=opt_time_limit, out=out))
