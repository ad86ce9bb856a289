"""The `lynx` command line: inspect, plan, show, compare, bench, calibrate.

Each sub-command lives in its own module and registers itself on :data:`app`.

Example::

    $ lynx inspect gpt-tiny --target cpu
"""

from __future__ import annotations

import gc
import sys

import typer
from rich.console import Console

from lynx.errors import LynxError

__all__ = ["app", "main", "table_console"]

app = typer.Typer(
    name="lynx",
    help="Plan activation recomputation inside communication windows.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def table_console() -> Console:
    """Console for tables on stdout: the terminal's width, or 200 columns when stdout is a file
    or pipe (rich would assume 80 and truncate wide columns)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


# Sub-command modules: importing one registers its commands on `app`.
from lynx.cli import calibrate_cmd, inspect_cmd, plan_cmd, compare_cmd  # noqa: E402,F401  (the order of --help)


def main() -> None:
    """Console-script entry point: runs the app, printing Lynx errors without a traceback."""
    try:
        app()
    except LynxError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        # The process is about to exit: spare the interpreter's last collections over the
        # millions of objects torch and its tracer leave.
        gc.freeze()
