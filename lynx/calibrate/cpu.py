"""What a CPU rank costs: op overhead of generated code, matmul and elementwise rates, random numbers, optimizer steps.

Rates are fitted to the forward times of a small GPT's own nodes (``gpt-tiny`` at seq 64 × 8,
``examples/train_gpt.py``'s shapes) as :func:`lynx.frontend.measure.measure_times` times them, each less
the eager op overhead: matmul nodes give FLOP/s, the rest bytes moved per second, random ops
(dropout) the seconds per random number beyond their memory traffic. Microbenchmarks that
reuse one buffer hit the cache and overstate both rates 1.5-5×; in a forward the activations
are fresh memory, so a model's own ops are the reference. bf16 and fp16 matmul rates are the
fp32 fit scaled by a matmul of gpt-tiny's shape timed in each dtype. Optimizer steps are timed
on gpt-tiny's parameters (one rank, no exchange).

The host cost of one op of the generated graphs stages run is measured on generated code
directly: gpt-tiny at seq 4 × 1 compiled as one stage, where an op's arithmetic is a few
hundred nanoseconds, timed forward and backward and divided by the ops it runs (the little
arithmetic the rates price is taken off first). Everything here runs on the calling thread and
is timed by its CPU clock, the fastest of several runs (:func:`lynx.calibrate.repeats.fastest`).

Example::

    >>> import torch
    >>> from lynx.calibrate.cpu import op_overhead_s
    >>> 0 < op_overhead_s(ops=200, runs=2).seconds < 1e-3
    True
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lynx.calibrate.repeats import Timing, fastest

__all__ = [
    "MATMUL_OPS",
    "OPTIMIZERS",
    "ReferenceModel",
    "op_overhead_s",
    "node_rates",
    "fit_node_rates",
    "generated_graphs_s",
    "start_generated_graphs_s",
    "generated_graphs_results",
    "generated_ops",
    "priced_graphs_s",
    "generated_op_overhead_s",
    "matmul_dtype_ratios",
    "optimizer_s_per_param",
]

MATMUL_OPS = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "conv")
OPTIMIZERS = ("adamw", "demo", "lion")


class ReferenceModel:
    """gpt-tiny at the given shapes, captured, profiled and planned (``pp`` stages of ``tp``
    ranks, everything kept) once for every repeat; ``compiled`` is what
    :class:`lynx.runtime.Pipeline` runs. :meth:`layout` plans the same capture for another
    ``pp`` × ``tp`` (a capture and profile cost ~1-2 s each)."""

    def __init__(self, seq: int = 64, microbatch: int = 8, pp: int = 1, microbatches: int = 4, tp: int = 1) -> None:
        import lynx

        torch.manual_seed(0)
        self.resolved = lynx.models.resolve_model("gpt-tiny", seq=seq, microbatch=microbatch, device="cpu")
        self.compiled = lynx.compile(self.resolved.model, self.resolved.example_inputs, pp=pp, tp=tp,
                                     microbatches=microbatches, solver="none", hardware="cpu-local", target="cpu")
        self.analysis = self.compiled.analysis
        self._stage: Any = None

    def layout(self, pp: int = 1, tp: int = 1, microbatches: int = 4) -> "ReferenceModel":
        """The same model and shapes planned for ``pp`` stages of ``tp`` ranks, from this capture."""
        from lynx.compiler import compile_analysis

        other = object.__new__(ReferenceModel)
        other.resolved, other._stage = self.resolved, None
        other.compiled = compile_analysis(self.analysis, pp=pp, tp=tp, microbatches=microbatches, solver="none",
                                          hardware="cpu-local", target="cpu")
        other.analysis = other.compiled.analysis
        return other

    def one_stage(self) -> Any:
        """The whole reference as one compiled stage that keeps everything, built once: its
        first run traces and partitions the joint graph (~1 s), which every later run reuses."""
        if self._stage is None:
            from lynx.rewrite.build import build_stages

            (self._stage,) = build_stages(self.analysis.captured.gm, [list(self.analysis.graph.nodes)])
            _run_microbatches(self._stage, self.analysis.captured.example_inputs, 1)   # the trace
        return self._stage


def _run_microbatches(stage: Any, inputs: Any, in_flight: int) -> None:
    """``in_flight`` microbatches through ``stage``: all forwards, then all backwards."""
    losses = [stage(*inputs, microbatch=j) for j in range(in_flight)]
    for j, loss in enumerate(losses):
        (loss[0] if isinstance(loss, tuple) else loss).backward()
        stage.release(j)


def op_overhead_s(ops: int = 2000, runs: int = 5) -> Timing:
    """Seconds of one eager op on a 4-element tensor: dispatch, allocation, no work to speak of."""
    x = torch.randn(4)
    t = fastest(lambda: [x.add(1.0) for _ in range(ops)], runs)
    return Timing(t.seconds / ops, t.cpu_share)


def node_rates(reference: ReferenceModel, overhead_s: float, runs: int = 5) -> dict[str, float]:
    """``matmul_flops``, ``memory_bandwidth`` and ``rng_s_per_element`` fitted to the reference's
    nodes (each the fastest of ``runs`` in CPU time), and ``cpu_share`` of the pass."""
    from lynx.frontend.measure import measure_times

    wall, cpu = time.perf_counter(), time.thread_time()
    G = measure_times(reference.analysis.graph.copy(), reference.analysis.captured, repeats=runs, statistic=min,
                      clock=time.thread_time)
    share = min(1.0, (time.thread_time() - cpu) / max(time.perf_counter() - wall, 1e-9))
    return {**fit_node_rates(G, overhead_s), "cpu_share": share}


def fit_node_rates(timed: Any, overhead_s: float) -> dict[str, float]:
    """``matmul_flops``, ``memory_bandwidth`` and ``rng_s_per_element`` from a graph whose nodes
    carry measured ``forward_s`` (:func:`lynx.frontend.measure.measure_times`), each node's time
    less ``overhead_s``: matmuls' FLOPs over their time, the bytes the other ops move over
    theirs, and random ops' time beyond moving their bytes per random element."""
    from lynx.planner.cost import random_elements

    flops = matmul_s = moved = moved_s = 0.0
    random_nodes = []
    for _, attrs in timed.nodes(data=True):
        if attrs.get("is_view"):
            continue
        t = max(0.0, attrs["forward_s"] - overhead_s)
        if random_elements(attrs):
            random_nodes.append((attrs, t))
        elif attrs.get("flops", 0) > 0 and any(w in str(attrs.get("op")) for w in MATMUL_OPS):
            flops, matmul_s = flops + attrs["flops"], matmul_s + t
        else:
            moved, moved_s = moved + attrs["input_bytes"] + attrs["output_bytes"], moved_s + t
    bandwidth = moved / max(moved_s, 1e-12)
    elements = sum(random_elements(a) for a, _ in random_nodes)
    rng_s = sum(t - (a["input_bytes"] + a["output_bytes"]) / bandwidth for a, t in random_nodes)
    return {
        "matmul_flops": flops / max(matmul_s, 1e-12),
        "memory_bandwidth": bandwidth,
        "rng_s_per_element": max(0.0, rng_s) / elements if elements else 0.0,
    }


def generated_graphs_s(reference: ReferenceModel, in_flight: int = 4, runs: int = 5,
                       min_total_s: float = 0.0) -> Timing:
    """CPU seconds per microbatch of the reference's generated forward and backward graphs.

    The reference runs as one compiled stage that keeps everything, ``in_flight`` microbatches
    forward then backward (a pipeline stage holds several); the fastest of ``runs`` and of as
    many as ``min_total_s`` of CPU time takes. The stage is built and traced once per reference
    (:meth:`ReferenceModel.one_stage`), so repeats time the same code without tracing it again."""
    stage, inputs = reference.one_stage(), reference.analysis.captured.example_inputs
    t = fastest(lambda: _run_microbatches(stage, inputs, in_flight), runs, min_total_s)
    for p in stage.parameters():
        p.grad = None
    return Timing(t.seconds / in_flight, t.cpu_share)


def start_generated_graphs_s(reference: ReferenceModel, runs: int = 3, timeout_s: float = 120.0) -> Any:
    """:func:`generated_graphs_s` of ``reference`` in a forked process: it builds and traces the
    stage (~1 s of CPU) beside this one, then times it once let go
    (:class:`lynx.calibrate.forked.Staged`; :func:`generated_graphs_results` lets it)."""
    from lynx.calibrate.forked import Staged

    return Staged(_graphs_worker, 1, (reference, runs), timeout_s)


def generated_graphs_results(started: Any) -> float:
    """What :func:`start_generated_graphs_s` measured: CPU seconds per microbatch."""
    from lynx.errors import LynxRuntimeError

    items, missing = started.results()
    result = dict(items).get(0, missing)
    if not isinstance(result, float):
        raise LynxRuntimeError(f"could not time the reference's generated graphs in a forked process: {result}")
    return result


def _graphs_worker(rank: int, gate: Any, reference: ReferenceModel, runs: int) -> float:
    """The forked process of :func:`start_generated_graphs_s`: traces, waits, times."""
    from lynx.calibrate.forked import GO_WAIT_S

    torch.set_num_threads(1)
    reference.one_stage()
    gate.prepared(GO_WAIT_S)
    return generated_graphs_s(reference, runs=runs).seconds


def generated_ops(reference: ReferenceModel) -> int:
    """Ops the reference's generated forward and backward graphs run per microbatch (the
    profile counts them per node from the joint graph: ``forward_ops`` / ``backward_ops``)."""
    graph = reference.analysis.graph
    return sum((graph.nodes[n].get("forward_ops") or 0) + (graph.nodes[n].get("backward_ops") or 0) for n in graph)


def priced_graphs_s(reference: ReferenceModel, rates: dict[str, float], op_s: float = 0.0) -> float:
    """What the cost model prices one microbatch's forward and backward of the reference at:
    the arithmetic from ``rates`` (:func:`node_rates`) and ``op_s`` per generated op."""
    from lynx.planner.cost import node_backward_s, node_forward_s
    from lynx.planner.hardware import HardwareSpec, LinkSpec

    graph = reference.analysis.graph
    link = LinkSpec(alpha_s=0.0, beta_bytes_per_s=1e9)  # unused: no communication is priced
    spec = HardwareSpec(name="reference", device="cpu", peak_flops={"float32": rates["matmul_flops"]},
                        achievable_fraction=1.0, memory_bandwidth=rates["memory_bandwidth"], memory_bytes=2**30,
                        links={"pp": link, "tp": link, "dp": link}, op_overhead_s=op_s,
                        rng_s_per_element=rates["rng_s_per_element"])
    dtype = str(graph.graph.get("dims", {}).get("dtype") or "float32")
    return sum(node_forward_s(graph.nodes[n], spec, dtype) + node_backward_s(graph.nodes[n], spec, dtype)
               for n in graph)


def generated_op_overhead_s(small: ReferenceModel, rates: dict[str, float], graphs_s: float) -> float:
    """Host seconds per op of generated code: ``graphs_s`` (:func:`generated_graphs_s` of a
    reference so small that arithmetic is a few percent of it) less that arithmetic, per op.

    It is what Python calling each op, dispatch, and the allocations around the kernels cost;
    measured, not the remainder of a large model's time (which is a few percent of it and so
    as unsteady as the rest of the fit)."""
    return max(0.0, graphs_s - priced_graphs_s(small, rates)) / max(generated_ops(small), 1)


def matmul_dtype_ratios(m: int = 512, k: int = 128, n: int = 512, runs: int = 3) -> dict[str, float]:
    """Per dtype, the speed of a ``(m, k) @ (k, n)`` matmul relative to float32's: the fastest of
    ``runs`` and of 10 ms of runs (a CPU without native bf16/fp16 takes ~50 ms for one of
    gpt-tiny's shape, so 2 runs of those: 0.1 s a repeat saved, their spread still ~5%)."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)  # (m, k), (k, n)
        torch.mm(a, b)
        times[str(dtype).removeprefix("torch.")] = fastest(lambda: torch.mm(a, b), runs if dtype == torch.float32
                                                           else min(runs, 2), min_total_s=0.01).seconds
    return {name: times["float32"] / t for name, t in times.items()}


def optimizer_s_per_param(reference: ReferenceModel, runs: int = 5) -> dict[str, Timing]:
    """Seconds per parameter of one step of AdamW, DeMo and DistributedLion on the reference's parameters."""
    from lynx.optim import DeMo, DistributedLion

    params = [p for p in reference.resolved.model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    makers: dict[str, Any] = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
        "demo": lambda: DeMo(params, lr=1e-3, process_group=None),
        "lion": lambda: DistributedLion(params, lr=1e-3, process_group=None),
    }
    saved = [p.detach().clone() for p in params]
    out = {}
    for name in OPTIMIZERS:
        opt = makers[name]()
        opt.step()  # state allocation, first-step work
        t = fastest(opt.step, runs, min_total_s=0.05)   # at least 50 ms of steps: a few ms each
        out[name] = Timing(t.seconds / count, t.cpu_share)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return out
