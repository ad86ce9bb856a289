"""What the runtime adds for tensor parallelism: the plan's TP windows per microbatch.

A plan's ``tp_allreduce`` windows (``s{d}.tp.l{L}.b.mb{j}``) are not actions of the pipeline
loop: they lie inside the backward graph, between layer ``L``'s backward all-reduces and their
waits. :func:`tp_window_schedule` hands them to the stage module
(``stage.tp_windows``), whose backward graph for microbatch ``j`` runs them there
(:mod:`lynx.rewrite.tp_windows`); the runner reports what they hid
(``StepStats.recompute_tp_hidden_s`` / ``recompute_tp_exposed_s``).

Example::

    >>> from types import SimpleNamespace
    >>> from lynx.planner.windows import WindowId
    >>> schedule = SimpleNamespace(prefetch={0: [(WindowId.tp(0, layer=3, microbatch=0), ["gelu_2", "matmul_2"]),
    ...                                          (WindowId.recv(0, "recv_grad", 0), ["gelu"])]})
    >>> tp_window_schedule(schedule, stage=0)
    {0: [(3, ['gelu_2', 'matmul_2'])]}
"""

from __future__ import annotations

from typing import Any

from lynx.planner.windows import as_window_id

__all__ = ["tp_window_schedule"]


def tp_window_schedule(schedule: Any, stage: int) -> dict[int, list[tuple[int, list[str]]]]:
    """Microbatch -> ``[(layer L, nodes)]`` of the stage's ``tp_allreduce`` windows (nodes in the
    plan's order, which is forward order)."""
    out: dict[int, list[tuple[int, list[str]]]] = {}
    for j, entries in schedule.prefetch.items():
        for wid, nodes in entries:
            window = as_window_id(wid)
            if window.kind != "tp_allreduce" or window.device != stage or window.layer is None:
                continue
            out.setdefault(int(j), []).append((window.layer, list(nodes)))
    return out
