"""Rows measured on every rank of a benchmark's worker job, handed to its driver on stdout.

A worker (one process per rank, started by :class:`lynx.testbed.NetBed`) gathers each rank's
rows to rank 0, which prints them as one JSON line; the driver finds that line in rank 0's
output. Used by ``overlap_cpu.py``, ``schedules_cpu.py``, ``tp_overlap.py`` and
``vs_torch_pipelining.py``.

    >>> import json
    >>> rows_from_stdout("noise\\n" + MARK + json.dumps([{"rep": 1}]) + "\\n")
    [{'rep': 1}]
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MARK", "print_rows", "rows_from_stdout"]

MARK = "LYNX_RESULT "


def print_rows(rows: list[dict[str, Any]]) -> None:
    """Every rank's ``rows``, in rank order, printed by rank 0 (a collective: every rank calls it)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        print(MARK + json.dumps([row for rank_rows in gathered for row in rank_rows]), flush=True)


def rows_from_stdout(stdout: str) -> list[dict[str, Any]]:
    """The rows rank 0 printed (:func:`print_rows`)."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"the worker printed no {MARK.strip()} line; its output ends:\n{stdout[-2000:]}")
    return json.loads(line[len(MARK):])
