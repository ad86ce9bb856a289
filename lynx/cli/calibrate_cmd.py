"""`lynx calibrate`: measure this machine into a hardware file (and the cache ``--hardware auto`` reads).

Example::

    $ lynx calibrate                       # measure, refresh the cache for --hardware auto
    $ lynx calibrate -o my_host.yaml       # ... and write a copy to edit or share
    $ lynx plan gpt-tiny --pp 2 --hardware my_host.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from lynx.cli import app, table_console

__all__ = ["calibrate_command", "calibration_rows"]

_UNITS = {  # field prefix -> (scale, unit)
    "peak_flops": (1e-9, "GFLOP/s"), "memory_bandwidth": (1e-9, "GB/s"), "op_overhead_s": (1e6, "µs"),
    "rng_s_per_element": (1e9, "ns/number"), "optimizer_s_per_param": (1e9, "ns/param"),
    "links.alpha_s": (1e6, "µs"), "links.beta_bytes_per_s": (1e-9, "GB/s"), "runtime_action_s": (1e6, "µs/action"),
    "links.tp.alpha_s": (1e6, "µs"), "links.tp.beta_bytes_per_s": (1e-9, "GB/s"),
    "host_link.alpha_s": (1e6, "µs"), "host_link.d2h": (1e-9, "GB/s"), "host_link.h2d": (1e-9, "GB/s"),
}


def calibration_rows(spec: Any) -> list[tuple[str, float, str, Optional[float]]]:
    """``(field, value in its unit, unit, spread or None)`` for every measured field of ``spec``."""
    spread = spec.calibration.spread if spec.calibration else {}
    link = spec.links["pp"]
    values = {f"peak_flops.{k}": v for k, v in spec.peak_flops.items()}
    values.update({"memory_bandwidth": spec.memory_bandwidth, "op_overhead_s": spec.op_overhead_s,
                   "rng_s_per_element": spec.rng_s_per_element, "runtime_action_s": spec.runtime_action_s,
                   **{f"optimizer_s_per_param.{k}": v for k, v in spec.optimizer_s_per_param.items()},
                   "links.alpha_s": link.alpha_s, "links.beta_bytes_per_s": link.beta_bytes_per_s})
    if spec.links["tp"] != link:  # measured apart: a TP stage's all-reduces (lynx.calibrate.allreduce)
        values.update({"links.tp.alpha_s": spec.links["tp"].alpha_s,
                       "links.tp.beta_bytes_per_s": spec.links["tp"].beta_bytes_per_s})
    if spec.host_link is not None:
        values.update({f"host_link.{k}": getattr(spec.host_link, k)
                       for k in ("alpha_s", "d2h_bytes_per_s", "h2d_bytes_per_s")})
    rows = []
    for field, value in values.items():
        scale, unit = next(u for prefix, u in _UNITS.items() if field.startswith(prefix))
        rows.append((field, value * scale, unit, spread.get(field)))
    return rows


@app.command("calibrate")
def calibrate_command(
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="also write the hardware file here (.yaml or .json)"
    ),
    repeats: int = typer.Option(
        5, "--repeats", help="times each quantity is measured (the spec keeps the rates' median, the host costs' "
                             "and links' best)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: cuda where present)"),
) -> None:
    """Measure this machine (rates, overheads, links; about 20 s) into the cache `--hardware auto` reads."""
    from lynx.errors import LynxConfigError, LynxError
    from lynx.planner.hardware_cache import auto_path
    from lynx.planner.hardware_files import write_hardware_file

    def go() -> None:
        if repeats < 1:
            raise LynxConfigError(f"--repeats must be >= 1, got {repeats}")
        if device not in (None, "cpu", "cuda"):
            raise LynxConfigError(f"--device must be cpu or cuda, got {device!r}")
        from lynx.calibrate import calibrate_host

        spec = calibrate_host(progress=True, repeats=repeats, device=device)
        written = [write_hardware_file(spec, auto_path())]
        if output is not None:
            written.append(write_hardware_file(spec, output))
        _print(spec, written)

    try:
        go()
    except LynxError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _print(spec: Any, written: list[Path]) -> None:
    cal = spec.calibration
    console = table_console()
    table = Table(
        title=f"{spec.name} ({spec.device}): {cal.repeats} measurements each, rates' median, host costs' best",
        caption="spread: (max − min) / median over the repeats; core: the least share of a core a repeat's runs "
                "got (CPU time / wall time); !: not repeatable, see below",
    )
    for column in ("field", "value", "unit", "spread", "core", ""):
        table.add_column(column, justify="left" if column in ("field", "unit", "") else "right")
    for field, value, unit, spread in calibration_rows(spec):
        share = cal.cpu_share.get(field)
        table.add_row(field, f"{value:.4g}", unit, "-" if spread is None else f"{spread:.0%}",
                      "-" if share is None else f"{share:.0%}", "[red]![/]" if field in cal.unreliable else "")
    console.print(table)
    for note in cal.notes:
        console.print(f"  note: {note}")
    for field, why in cal.unreliable.items():
        console.print(f"  [red]unreliable[/] {field}: {why}")
    console.print(
        f"calibrated in {cal.seconds:.1f} s at load {cal.load_before:.2f} → {cal.load_after:.2f} "
        f"on {cal.cpus} cpus; written to {', '.join(str(p) for p in written)}"
    )
