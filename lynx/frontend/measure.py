"""Measure mode: time every node of a captured graph for real on the current device.

The analytic cost model (:mod:`lynx.planner.cost`) prices nodes from FLOPs and bytes; this
module replaces those figures by running each node ``repeats`` times through an fx interpreter
and keeping a statistic of the times (``forward_s``; ``backward_s`` from the node's own
autograd backward where it has one): wall time by default, or any ``clock`` — ``time.thread_time``
on a CPU, so that other processes taking the core do not count (``lynx calibrate`` does).

Example::

    >>> import lynx
    >>> from lynx.frontend.measure import measure_times
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> analysis = lynx.analyze(model, inputs, target="cpu", hardware="cpu-local")
    >>> G = measure_times(analysis.graph.copy(), analysis.captured, repeats=1)
    >>> all(G.nodes[n]["forward_s"] >= 0 for n in G)
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
from torch import fx

from lynx.errors import LynxConfigError, LynxProfileError
from lynx.frontend.capture import Captured, is_op_node
from lynx.torch_private import tree_flatten, tree_map

__all__ = ["measure_times"]



def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, repeats: int, statistic: Callable[[list[float]], float],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(gm)
        self.repeats, self.statistic, self.clock = repeats, statistic, clock
        self.times: dict[str, tuple[float, float]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_module" and n.target == "_guards_fn":
            return None
        out = super().run_node(n)
        if not is_op_node(n):
            return out
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        leaves = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        device = leaves[0].device if leaves else torch.device("cpu")

        def fresh() -> tuple[Any, Any, list[torch.Tensor]]:
            grads: list[torch.Tensor] = []

            def detach(a: Any) -> Any:
                if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad:
                    d = a.detach().requires_grad_(True)
                    grads.append(d)
                    return d
                return a

            a, k = tree_map(detach, (args, kwargs))
            return a, k, grads

        forward, backward = [], []
        for _ in range(self.repeats):
            a, k, wrt = fresh()
            _sync(device)
            start = self.clock()
            result = getattr(self, n.op)(n.target, a, k)
            _sync(device)
            forward.append(self.clock() - start)
            outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and wrt:
                seeds = [torch.ones_like(t) for t in outs]
                _sync(device)
                start = self.clock()
                torch.autograd.grad(outs, wrt, seeds, allow_unused=True)
                _sync(device)
                backward.append(self.clock() - start)
        self.times[n.name] = (self.statistic(forward), self.statistic(backward) if backward else 0.0)
        return out


def measure_times(G: nx.DiGraph, captured: Captured, repeats: int = 3,
                  statistic: Callable[[list[float]], float] = statistics.median,
                  clock: Callable[[], float] = time.perf_counter) -> nx.DiGraph:
    """Time every node for real on the device the model's parameters live on (measure mode);
    each node's time is ``statistic`` of its ``repeats`` runs (``min``: the least disturbed),
    read from ``clock`` (a CPU-time clock only times work on this thread: not a GPU's)."""
    if captured.folded is not None or any(p.is_meta for p in captured.gm.parameters()):
        raise LynxConfigError(
            "measure mode times real ops: build the model with real weights on the device to time "
            "(not on meta), or use the analytic cost model"
        )
    interp = _TimingInterpreter(captured.gm, repeats, statistic, clock)
    try:
        with torch.enable_grad():
            interp.run(*captured.example_inputs)
    except Exception as err:  # noqa: BLE001
        raise LynxProfileError(f"measure mode failed at a node: {type(err).__name__}: {err}") from err
    for name, (fwd, bwd) in interp.times.items():
        if name in G:
            G.nodes[name]["forward_s"] = fwd
            G.nodes[name]["backward_s"] = bwd
    G.graph["time_source"] = "measured"
    return G
