"""``lynx inspect MODEL``: per layer class FLOPs, saved activation bytes and times.

Example::

    $ lynx inspect gpt-1.3b --seq 2048 --microbatch 1 --hardware a100-80g
    $ lynx inspect mypkg.models:make_model --json
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from lynx.cli import app, table_console
from lynx.units import format_size
from lynx.frontend.analyze import analyze
from lynx.frontend.inspect import InspectReport, report_from_analysis
from lynx.models import resolve_model

__all__ = ["inspect", "format_seconds", "format_flops"]


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def format_flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f} FLOP"


def _print_report(report: InspectReport, console: Console) -> None:
    d = report.dims
    console.print(
        f"[bold]{report.model}[/bold]  target [cyan]{report.target}[/cyan] ({report.hardware})  "
        f"hidden {d.get('hidden')}  heads {d.get('heads')}  layers {d.get('layers')}  seq {d.get('seq')}  "
        f"microbatch {d.get('microbatch')}  dtype {d.get('dtype')}  capture {report.capture}"
        + ("  (folded: repeated layers captured once and replicated)" if report.folded else "")
    )
    if report.emulated_ops:
        console.print(f"saved tensors of {', '.join(report.emulated_ops)} emulated for the CUDA target")
    table = Table(title="per layer class (values per instance)")
    for col in ("layer class", "count", "nodes", "FLOPs", "saved activations", "forward", "backward"):
        table.add_column(col, justify="left" if col == "layer class" else "right")
    for c in report.classes:
        table.add_row(c.layer_class, str(c.count), str(c.nodes), format_flops(c.flops), format_size(c.saved_bytes),
                      format_seconds(c.forward_s), format_seconds(c.backward_s))
    t = report.totals
    table.add_section()
    table.add_row(
        "total",
        str(sum(c.count for c in report.classes)),
        str(sum(c.count * c.nodes for c in report.classes)),
        format_flops(t.flops),
        format_size(t.saved_bytes),
        format_seconds(t.forward_s),
        format_seconds(t.backward_s),
    )
    console.print(table)


@app.command()
def inspect(
    model: str = typer.Argument(
        ..., help="Preset (gpt-1.3b … gpt-20b, llama-7b, gpt-tiny, llama-tiny) or module:factory."
    ),
    seq: Optional[int] = typer.Option(None, help="Sequence length (presets)."),
    microbatch: Optional[int] = typer.Option(None, help="Microbatch size (presets)."),
    dtype: Optional[str] = typer.Option(None, help="fp16 | bf16 | fp32."),
    attention: Optional[str] = typer.Option(None, help="math | sdpa (GPT presets)."),
    hardware: str = typer.Option(
        "h100-sxm",
        help="a preset (cpu-local, h100-sxm, a100-25gbe, ...), a hardware file (.yaml/.json) "
        "or auto (this machine, measured).",
    ),
    target: Optional[str] = typer.Option(None, help="cuda | cpu (default: the hardware's device)."),
    measure: bool = typer.Option(False, "--measure", help="Time the real nodes on this device (needs real weights)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    offload: bool = typer.Option(False, "--offload", help="Also list the saved values offload could move to host "
                                 "memory (each layer class's first instance), which first and why."),
) -> None:
    """Profile MODEL: per layer class FLOPs, saved activation bytes, forward and backward time.

    With ``--offload``: every saved value is an offload candidate (copied to host memory after
    its forward, back before its backward, on the hardware's host link); each is marked
    "offload first" (dear to recompute per byte: the solvers fill the copy lanes with these
    first) or "recompute first", with the figures behind it."""
    resolved = resolve_model(
        model,
        seq=seq,
        microbatch=microbatch,
        dtype=dtype,
        attention=attention,
        device="cpu" if measure and ":" not in model else "meta",
    )
    from lynx.errors import LynxError
    from lynx.planner.offload_candidates import offload_candidates

    analysis = analyze(resolved.model, resolved.example_inputs, target=target,  # type: ignore[arg-type]
                       hardware=hardware, times="measure" if measure else "analytic", dims=resolved.dims,
                       name=resolved.name)
    report = report_from_analysis(analysis)
    candidates = []
    if offload:
        try:
            candidates = offload_candidates(analysis.graph, analysis.hardware)
        except LynxError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None
    if as_json:
        record = report.json_record()
        if offload:
            record["offload_candidates"] = [c.record() for c in candidates]
        print(json.dumps(record, indent=2))
    else:
        console = table_console()
        _print_report(report, console)
        if offload:
            _print_candidates(candidates, console)


def _print_candidates(candidates: list, console: Console) -> None:
    table = Table(title="offload candidates (each layer class's first instance): every saved value may go to host "
                        "memory; which first, and why")
    for col in ("layer class", "node", "op", "saved", "recompute", "copy out", "verdict", "why"):
        table.add_column(col, justify="right" if col in ("saved", "recompute", "copy out") else "left")
    for c in candidates:
        table.add_row(c.layer_class, c.node, c.op, format_size(c.saved_bytes), format_seconds(c.recompute_s),
                      format_seconds(c.copy_s), c.verdict, c.why)
    console.print(table)
    console.print("a value a stage sends to the next is held until its backward whatever the plan: never offloaded")
