"""``python -m lynx.calibrate --output PATH``: measure this host in a process of its own.

``hardware="auto"`` runs this when no measurement is cached, so that measuring never touches
the caller's process: its random state, thread settings or process group.
"""

from __future__ import annotations

import argparse
import sys

from lynx.calibrate.host import calibrate_host
from lynx.errors import LynxError
from lynx.planner.hardware_files import write_hardware_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lynx.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, help="the hardware file to write (.json or .yaml)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = ap.parse_args(argv)
    try:
        write_hardware_file(calibrate_host(progress=True, repeats=args.repeats, device=args.device), args.output)
    except LynxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
