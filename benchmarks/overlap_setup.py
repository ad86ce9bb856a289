"""Model, data, plans and single-thread stage costs of ``benchmarks/overlap_cpu.py``.

The model is a small GPT (``CFG``, microbatch ``MICROBATCH``) split into two stages; the plan
is either Lynx's own (:func:`lynx_plan`: ``lynx.compile``'s solvers on this machine's measured
node times, the bed's link rate, a budget that forces recomputation) or a hand-made one of the
same shape (:func:`make_schedules`). :func:`stage_costs` measures what each stage's forward,
backward and recomputation cost on one thread, for the event model
(``benchmarks/overlap_model.py``).
"""

from __future__ import annotations

import statistics
import time

import torch

from lynx.models import GPT, GPTConfig
from lynx.rewrite.stage import StageModule

__all__ = ["CFG", "MICROBATCH", "build_model", "lynx_plan", "make_schedules", "stage_costs", "token_batches"]

CFG = {"vocab_size": 512, "seq_len": 256, "hidden": 256, "heads": 4, "layers": 2, "dropout": 0.1}
MICROBATCH = 2
VARIANTS = ("none", "checkpoint", "on-demand", "lynx")


def build_model() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    idx = torch.randint(0, CFG["vocab_size"], (MICROBATCH, CFG["seq_len"]))  # (B, T)
    return model, (idx, idx.roll(-1, dims=1))


def token_batches(names: list[str], step: int, dp_rank: int, m: int) -> list[dict[str, torch.Tensor]]:
    """Random tokens and next-token targets, the same for every variant of one repetition."""
    out = []
    for j in range(m):
        gen = torch.Generator().manual_seed(step * 10_007 + dp_rank * 101 + j)
        idx = torch.randint(0, CFG["vocab_size"], (MICROBATCH, CFG["seq_len"]), generator=gen)  # (B, T)
        out.append({names[0]: idx, names[1]: idx.roll(-1, dims=1)})
    return out



def lynx_plan(pp: int, microbatches: int, schedule: str, rate_mbit: float, solver: str = "opt"):
    """Lynx's plan for this model, calibrated to this machine: node times measured on one thread
    (``lynx.analyze(times="measure")``), the pp/dp links at the bed's rate (95.5% of nominal
    achieved, 0.3 ms latency), and the budget of Megatron-full recomputation (the ``full``
    baseline's stage-0 peak; at least the last stage's keep-all peak, so that one fits)."""
    import lynx
    from lynx.planner.loop import plan_graph
    from lynx.config import CompileConfig
    from lynx.planner.hardware import LinkSpec, get_hardware
    from lynx.rewrite.build import stage_node_lists

    torch.set_num_threads(1)
    model, inputs = build_model()
    base = get_hardware("cpu-local")
    link = LinkSpec(alpha_s=3e-4, beta_bytes_per_s=rate_mbit * 0.955e6 / 8)
    hw = base.model_copy(update={"links": {**base.links, "pp": link, "dp": link}})
    graph = lynx.analyze(model, inputs, target="cpu", hardware=hw, times="measure").graph
    common = {"pp": pp, "microbatches": microbatches, "schedule": schedule, "hardware": hw, "target": "cpu"}
    keep = plan_graph(graph, CompileConfig(solver="none", memory_budget=1 << 40, **common))
    full = plan_graph(graph, CompileConfig(solver="full", memory_budget=1 << 40, **common))
    budget = max(full.stages[0].peak_memory_bytes, keep.stages[-1].peak_memory_bytes)
    plan = plan_graph(graph, CompileConfig(solver=solver, memory_budget=budget, time_limit_s=60, **common))
    nodes = stage_node_lists(plan)
    schedules = []
    for s in range(pp):
        sched = plan.stage_schedule(s)
        schedules.append({"dropped": sorted(sched.dropped),
                          "prefetch": {j: [(w, list(n)) for w, n in v] for j, v in sched.prefetch.items()}})
    windowed = sum(len(n) for v in schedules[0]["prefetch"].values() for _w, n in v)
    return nodes, schedules, (
        f"lynx.compile(solver={solver!r}) on measured single-thread node times, links {rate_mbit:g} Mbit/s, "
        f"memory_budget={budget} B (Megatron-full's stage-0 peak): status {plan.status}, stage 0 drops "
        f"{len(schedules[0]['dropped'])} nodes, {windowed} node recomputations placed in windows over the "
        f"{microbatches} microbatches; predicted step {plan.predicted.step_time_s:.3f} s (keep-all "
        f"{keep.predicted.step_time_s:.3f} s, Megatron-full {full.predicted.step_time_s:.3f} s), exposed "
        f"{plan.predicted.exposed_recompute_s:.3f} s, hidden {plan.predicted.hidden_recompute_s:.3f} s")


def make_schedules(pp: int, microbatches: int) -> tuple[list[list[str]], list[dict], str]:
    """A hand-made plan of the solvers' shape (Megatron-full drops on all but the last stage,
    the stage's last layer in each recv_grad window) — the shape OPT finds for this model on
    this machine's measured costs when it places windows (see docs/runtime.md)."""
    import lynx

    model, inputs = build_model()
    analysis = lynx.analyze(model, inputs, target="cpu", hardware="cpu-local")
    G = analysis.graph
    blocks = G.graph["blocks"]
    # pre + first layers | last layers + post: layers split evenly
    layer_blocks = [b for b in blocks if b["kind"] == "layer"]
    per_stage = len(layer_blocks) // pp
    nodes: list[list[str]] = []
    for s in range(pp):
        chosen = layer_blocks[s * per_stage:(s + 1) * per_stage]
        names = [n for b in chosen for n in b["nodes"]]
        if s == 0:
            names = [n for b in blocks if b["kind"] == "edge" and b["index"] == 0 for n in b["nodes"]] + names
        if s == pp - 1:
            names += [n for b in blocks if b["kind"] == "edge" and b["index"] != 0 for n in b["nodes"]]
        nodes.append(names)
    # Megatron-full drops on every stage but the last (which holds one microbatch in 1F1B):
    # keep each layer's input, drop the rest of the layer.
    schedules = []
    for s in range(pp):
        dropped: list[str] = []
        if s < pp - 1:
            for b in layer_blocks[s * per_stage:(s + 1) * per_stage]:
                dropped += b["nodes"][:-1]  # the last node (residual add) is the next layer's input
        # the window before B(j) re-runs the last layer's drops (one layer: the memory on-demand
        # recompute needs for its transient anyway); earlier layers stay on demand
        last_layer = set(layer_blocks[(s + 1) * per_stage - 1]["nodes"]) if s < pp - 1 else set()
        window_nodes = [n for n in dropped if n in last_layer]
        prefetch = {j: [(f"s{s}.recv_grad.mb{j}", window_nodes)] for j in range(microbatches)} if window_nodes else {}
        schedules.append({"dropped": dropped, "prefetch": prefetch})
    return nodes, schedules, "hand-made (Megatron-full drops, last layer of the stage in each recv_grad window)"


def stage_costs(nodes: list[list[str]], schedules: list[dict]) -> dict:
    """Single-thread CPU milliseconds (thread time: what other jobs on the machine do not inflate)
    per microbatch of each stage: forward, backward (keep all) and the recomputation of its
    dropped nodes in forward order; and the boundary bytes."""
    from lynx.frontend.capture import capture
    from lynx.rewrite.build import split_cached

    torch.set_num_threads(1)
    model, inputs = build_model()
    captured = capture(model, inputs)
    parts = split_cached(captured.gm, nodes)
    batch = dict(zip(captured.input_names, inputs))
    out: dict = {"stages": []}
    received: list[torch.Tensor] = []
    for s, part in enumerate(parts):
        keep, drop = StageModule(part), StageModule(part, schedules[s]["dropped"])
        times = []
        for j in range(8):  # the first two warm up (allocator, caches): they are dropped
            leaves = [r.detach().requires_grad_(r.is_floating_point()) for r in received]
            args = [batch[n] for n in keep.spec.inputs] + leaves
            t0 = time.thread_time()
            res = keep(*args, microbatch=j)
            t1 = time.thread_time()
            if keep.spec.is_last:
                res.backward()
            else:
                torch.autograd.backward(list(res), [torch.ones_like(o) for o in res])
            t2 = time.thread_time()
            keep.release(j)
            drop(*args, microbatch=j)
            t3 = time.thread_time()
            if drop.dropped:
                drop.recompute(j, [n for n in drop.spec.nodes if n in drop.dropped])
            t4 = time.thread_time()
            drop.release(j)
            if j >= 2:
                times.append((t1 - t0, t2 - t1, t4 - t3))
        if not keep.spec.is_last:
            received = list(res)
            out["boundary_bytes"] = sum(o.numel() * o.element_size() for o in res)
        out["stages"].append({k: statistics.median(t[i] for t in times) * 1e3
                              for i, k in enumerate(("forward_ms", "backward_ms", "recompute_ms"))})
    return out


