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
from lynx.frontend.inspect import InspectReport, inspect_model
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
) -> None:
    """Profile MODEL: per layer class FLOPs, saved activation bytes, forward and backward time."""
    resolved = resolve_model(
        model,
        seq=seq,
        microbatch=microbatch,
        dtype=dtype,
        attention=attention,
        device="cpu" if measure and ":" not in model else "meta",
    )
    report = inspect_model(
        resolved.model,
        resolved.example_inputs,
        target=target,
        hardware=hardware,
        times="measure" if measure else "analytic",
        dims=resolved.dims,
        name=resolved.name,
    )
    if as_json:
        print(json.dumps(report.json_record(), indent=2))
    else:
        _print_report(report, table_console())
