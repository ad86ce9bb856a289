"""Overlapped vs on-demand recomputation, measured on real processes over rate-limited links.

Runs a GPT over ``pp`` × ``dp`` CPU ranks (one thread each) in the test bed's network
namespaces (``lynx.testbed.NetBed``: veth links limited with ``tc tbf``), 8 microbatches per
step, 1F1B, and in the same processes and run alternates four variants step by step:

* ``none``        keep every saved tensor (no recomputation; needs the most memory);
* ``checkpoint``  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around each
                  run of the plan's dropped nodes (for the hand plan: each layer but its final
                  residual add) — the baseline users compare against (Megatron full recompute);
* ``on-demand``   the same drops through Lynx's own hooks, recomputed when backward unpacks
                  them (the mechanism of non-reentrant checkpoint; only *when* differs from lynx);
* ``lynx``        the same drops, recomputed in the plan's windows while the gradient is on
                  the wire (whatever a window cannot hold stays on demand).

It prints, per topology, the median step time of each variant, the ratios (median over
repetitions of the per-repetition ratio: variants of one repetition run back to back), the
exposed and hidden recompute and the measured peak saved-activation bytes per stage, the link
rate and what a boundary transfer costs next to a stage's compute, the load average, and
what a no-noise event model of 2-stage 1F1B gives for the measured costs (the best ratio
they allow).
Results go to ``benchmarks/results/overlap_cpu.json``.

Usage::

    python benchmarks/overlap_cpu.py                       # pp 2 and pp 2 × dp 2, hand plan
    python benchmarks/overlap_cpu.py --dps 2 --rates 75 --optimizer allreduce   # AdamW all-reduce
    python benchmarks/overlap_cpu.py --plan heu --dps 1    # Lynx's HEU plan, calibrated here
    python benchmarks/overlap_cpu.py --dps 1 --reps 2 --trace   # print each rank's timeline
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._python_dispatch
from torch import fx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx.models import GPT, GPTConfig  # noqa: E402
from lynx.rewrite.stage import StageModule  # noqa: E402

CFG = dict(vocab_size=512, seq_len=256, hidden=256, heads=4, layers=2, dropout=0.1)
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


# ---------------------------------------------------------------- torch.utils.checkpoint baseline
class _RecomputeMeter(torch.utils._python_dispatch.TorchDispatchMode):
    """Registers every tensor an op produces while checkpoint recomputes (the saved ones stay
    alive until backward consumes them; the meter's weak references drop the others)."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        self.stage = stage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.stage.constant_ptrs:
                self.stage.meter.add(t, "stage")
        return out


class _Checkpointed(torch.nn.Module):
    """``torch.utils.checkpoint.checkpoint(sub, *args, use_reentrant=False)``, metering what it holds."""

    def __init__(self, sub: fx.GraphModule, n_out: int, meter: dict) -> None:
        super().__init__()
        self.sub, self.n_out = sub, n_out
        self.__dict__["meter"] = meter  # {"stage": CheckpointStage}, filled once the stage exists

    def forward(self, *args: torch.Tensor) -> tuple:
        from contextlib import nullcontext

        from torch.utils.checkpoint import checkpoint

        stage = self.meter["stage"]
        for a in args:  # checkpoint keeps its inputs for the re-run: resident like saved tensors
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in stage.constant_ptrs:
                stage.meter.add(a, "stage")
        out = checkpoint(self.sub, *args, use_reentrant=False,
                         context_fn=lambda: (nullcontext(), _RecomputeMeter(stage)))
        return tuple(out) if self.n_out > 1 else (out,)


class CheckpointStage(StageModule):
    """A stage that keeps everything except runs of ``dropped`` nodes, each executed under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (its own RNG-state save and
    re-run in backward; Lynx's hooks see nothing inside). Peak saved bytes count the kept
    tensors, checkpoint's held inputs and what its re-run produces until backward frees it."""

    def __init__(self, part: Any, dropped: set[str]) -> None:
        from lynx.rewrite.split import StageGraph

        holder: dict = {}
        gm = _outline(part.gm, part.spec.nodes, set(dropped), holder)
        super().__init__(StageGraph(gm, part.spec, part.out_spec))
        self.constant_ptrs = {t.untyped_storage().data_ptr() for t in self._exclude}
        holder["stage"] = self


def _outline(gm: fx.GraphModule, order: list[str], dropped: set[str], holder: dict) -> fx.GraphModule:
    """Copy of ``gm`` in which each maximal run of consecutive ``dropped`` op nodes is one
    checkpointed submodule (inputs: what the run reads from outside; outputs: what is read after)."""
    import operator

    runs: list[list[str]] = []
    prev = None
    for name in order:
        if name in dropped:
            if runs and runs[-1][-1] == prev:
                runs[-1].append(name)
            else:
                runs.append([name])
        prev = name
    run_of = {n: k for k, run in enumerate(runs) for n in run}
    nodes = {n.meta.get("lynx_name", n.name): n for n in gm.graph.nodes}
    root = torch.nn.Module()
    for name, mod in gm.named_children():
        root.add_module(name, mod)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, b)
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        name = node.meta.get("lynx_name", node.name)
        k = run_of.get(name)
        if k is None:
            env[node] = graph.node_copy(node, lambda a: env[a])
            continue
        if name != runs[k][-1]:
            continue  # emitted at the end of its run, when all of the run's inputs exist
        members = [nodes[n] for n in runs[k]]
        inside = set(members)
        inputs = list(dict.fromkeys(a for m in members for a in m.all_input_nodes if a not in inside))
        outputs = [m for m in members if any(u not in inside for u in m.users)]
        sub_graph, sub_env = fx.Graph(), {}
        for a in inputs:
            sub_env[a] = sub_graph.placeholder(a.name)
        for m in members:
            sub_env[m] = sub_graph.node_copy(m, lambda a: sub_env[a])
        sub_graph.output(tuple(sub_env[o] for o in outputs) if len(outputs) > 1 else sub_env[outputs[0]])
        root.add_module(f"ckpt{k}", _Checkpointed(fx.GraphModule(gm, sub_graph), len(outputs), holder))
        call = graph.call_module(f"ckpt{k}", tuple(env[a] for a in inputs))
        call.meta["lynx_name"] = f"ckpt{k}"
        for i, o in enumerate(outputs):
            env[o] = graph.call_function(operator.getitem, (call, i))
            env[o].meta = {**o.meta}
    return fx.GraphModule(root, graph)


# ----------------------------------------------------------------------------- planning
def lynx_plan(pp: int, microbatches: int, schedule: str, rate_mbit: float, solver: str = "opt"):
    """Lynx's plan for this model, calibrated to this machine: node times measured on one thread
    (``lynx.analyze(times="measure")``), the pp/dp links at the bed's rate (95.5% of nominal
    achieved, 0.3 ms latency), and the budget of Megatron-full recomputation (the ``full``
    baseline's stage-0 peak; at least the last stage's keep-all peak, so that one fits)."""
    import lynx
    from lynx.compile import plan_graph
    from lynx.config import CompileConfig
    from lynx.hardware import LinkSpec, get_hardware
    from lynx.rewrite.build import stage_node_lists

    torch.set_num_threads(1)
    model, inputs = build_model()
    base = get_hardware("cpu-local")
    link = LinkSpec(alpha_s=3e-4, beta_bytes_per_s=rate_mbit * 0.955e6 / 8)
    hw = base.model_copy(update={"links": {**base.links, "pp": link, "dp": link}})
    graph = lynx.analyze(model, inputs, target="cpu", hardware=hw, times="measure").graph
    common = dict(pp=pp, microbatches=microbatches, schedule=schedule, hardware=hw, target="cpu")
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


# ------------------------------------------------------------------------------- worker
def _renice(nice: int) -> None:
    """The machine is shared: as root, let the other jobs disturb this process less. With the
    scheduler's autogroups (one per session, equal shares) a thread's nice value only ranks it
    within its own session, so the session's autogroup (this process leads one: NetBed starts
    each rank in its own session) gets the niceness."""
    if not nice:
        return
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:
        try:
            os.nice(nice)
        except PermissionError:
            pass


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from lynx.capture import capture
    from lynx.plan import StageSchedule
    from lynx.rewrite.build import split_cached
    from lynx.runtime.pipeline import PipelineRunner, RuntimeConfig
    from lynx.runtime.topology import make_topology

    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    # Before gloo starts its threads (affinity and niceness are per thread; new ones inherit).
    # A core per rank where there are enough; else a stage's replicas share one core (they run
    # in step, so a core idles exactly when its stage waits; a core shared by the two stages of
    # one pipeline would hand stage 0's window to stage 1's compute, on the critical path).
    rank, world = int(os.environ["RANK"]), spec["pp"] * spec["dp"]
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)] if world <= len(cores) else cores[rank // spec["dp"] % len(cores)]})
    _renice(spec["nice"])
    dist.init_process_group("gloo")
    topo = make_topology(spec["pp"], spec["dp"])
    model, inputs = build_model()
    model.train()
    captured = capture(model, inputs)
    parts = split_cached(captured.gm, spec["nodes"])
    s = topo.stage
    sched = spec["schedules"][s]
    schedule = StageSchedule(dropped=frozenset(sched["dropped"]),
                             prefetch={int(j): [(w, n) for w, n in v] for j, v in sched["prefetch"].items()})
    stages = {"none": StageModule(parts[s]),
              "checkpoint": CheckpointStage(parts[s], schedule.dropped) if schedule.dropped else StageModule(parts[s]),
              "on-demand": StageModule(parts[s], schedule.dropped),
              "lynx": StageModule(parts[s], schedule.dropped)}
    m = spec["microbatches"]
    base = dict(schedule=spec["schedule"], microbatches=m, timeout_s=300, bucket_bytes=256 << 10,
                trace=spec.get("trace", False))
    optimizer = None
    if spec["optimizer"] == "lion" and topo.dp > 1:
        from lynx.optim import DistributedLion

        optimizer = DistributedLion(list(parts[s].gm.parameters()), lr=1e-5, process_group=topo.dp_group,
                                    bucket_bytes=256 << 10)
    runners = {v: PipelineRunner(stages[v], topo, RuntimeConfig(**base, prefetch=v == "lynx"),
                                 schedule=schedule if v != "none" else None, optimizer=optimizer)
               for v in VARIANTS}
    torch.manual_seed(1009 * topo.dp_rank + s)  # each rank its own dropout stream
    rows = []
    for rep in range(spec["reps"] + 1):  # rep 0 warms up
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]  # rotate: no fixed order
        for variant in order:
            dist.barrier()
            stats = runners[variant].step(token_batches(captured.input_names, rep, topo.dp_rank, m))
            if rep > 0:
                rows.append({"variant": variant, "rep": rep, **stats.as_dict()})
    gathered: list = [None] * topo.world
    dist.all_gather_object(gathered, rows)
    if topo.rank == 0:
        print("LYNX_RESULT " + json.dumps([r for rank_rows in gathered for r in rank_rows]))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver
def stage_costs(nodes: list[list[str]], schedules: list[dict]) -> dict:
    """Single-thread CPU milliseconds (thread time: what other jobs on the machine do not inflate)
    per microbatch of each stage: forward, backward (keep all) and the recomputation of its
    dropped nodes in forward order; and the boundary bytes."""
    from lynx.capture import capture
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
        for j in range(5):
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
            times.append((t1 - t0, t2 - t1, t4 - t3))
        if not keep.spec.is_last:
            received = list(res)
            out["boundary_bytes"] = sum(o.numel() * o.element_size() for o in res)
        out["stages"].append({k: statistics.median(t[i] for t in times) * 1e3
                              for i, k in enumerate(("forward_ms", "backward_ms", "recompute_ms"))})
    return out


def ideal_steps(costs: dict, transfer_ms: float, m: int, slowdown: float = 1.0) -> dict:
    """What each variant's step would take (ms) for 2 stages under 1F1B with nothing but the
    measured compute (CPU time × ``slowdown``: 2 where two ranks share a core) and transfers
    that queue on each link direction: no latency, no jitter. lynx recomputes mb j before
    B(j) as soon as its forward and the previous action are done, on-demand after the gradient
    arrived. Its lynx / on-demand is the best these costs and this rate allow."""
    c0, c1 = costs["stages"][0], costs["stages"][1]
    f0, b0, r = (c0[k] * slowdown for k in ("forward_ms", "backward_ms", "recompute_ms"))
    f1, b1 = c1["forward_ms"] * slowdown, c1["backward_ms"] * slowdown
    out = {}
    for variant in ("none", "on-demand", "lynx"):
        t0 = link_f = link_b = free1 = 0.0
        act: dict[int, float] = {}
        grad: dict[int, float] = {}
        for kind, j in [(a.kind, a.microbatch) for a in _actions(m)]:
            if kind == "F":
                t0 += f0
                link_f = max(t0, link_f) + transfer_ms
                act[j] = link_f
                continue
            for k in range(j + 1):  # stage 1 runs F(k) B(k) as activations arrive
                if k not in grad:
                    free1 = max(free1, act[k]) + f1 + b1
                    link_b = max(free1, link_b) + transfer_ms
                    grad[k] = link_b
            if variant == "none":
                t0 = max(t0, grad[j]) + b0
            elif variant == "on-demand":
                t0 = max(t0, grad[j]) + r + b0
            else:
                t0 = max(t0 + r, grad[j]) + b0
        out[variant] = max(t0, free1)
    out["lynx/on-demand"] = out["lynx"] / out["on-demand"]
    return out


def _actions(m: int) -> list:
    from lynx.runtime.schedule import stage_actions

    return stage_actions("1f1b", stage=0, stages=2, microbatches=m)


def summarize(rows: list[dict], pp: int, dp: int) -> dict:
    out: dict = {"pp": pp, "dp": dp, "variants": {}}
    reps = sorted({r["rep"] for r in rows})
    steps = {v: {k: max(r["step_s"] for r in rows if r["variant"] == v and r["rep"] == k) for k in reps}
             for v in VARIANTS}  # a step ends when its slowest rank does
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        per_stage = {}
        for s in range(pp):
            st = [r for r in mine if r["stage"] == s]
            per_stage[s] = {
                "exposed_recompute_s": statistics.median(r["exposed_recompute_s"] for r in st),
                "hidden_recompute_s": statistics.median(r["recompute_hidden_s"] for r in st),
                "wait_s": statistics.median(r["wait_s"] for r in st),
                "peak_saved_bytes": max(r["peak_saved_bytes"] for r in st),
                "peak_held_bytes": max(r["peak_held_bytes"] for r in st),
            }
        out["variants"][variant] = {"step_s": statistics.median(steps[variant].values()),
                                    "step_s_per_rep": [steps[variant][k] for k in reps], "stages": per_stage}

    def ratio(a: str, b: str) -> dict:
        per_rep = [steps[a][k] / steps[b][k] for k in reps]
        qs = statistics.quantiles(per_rep, n=4) if len(per_rep) > 1 else per_rep * 3
        return {"median": statistics.median(per_rep), "q1": qs[0], "q3": qs[2],
                "of_medians": out["variants"][a]["step_s"] / out["variants"][b]["step_s"]}

    out["ratios"] = {f"{a}/{b}": ratio(a, b) for a, b in
                     (("lynx", "checkpoint"), ("lynx", "on-demand"), ("lynx", "none"),
                      ("checkpoint", "none"), ("on-demand", "none"), ("on-demand", "checkpoint"))}
    return out


def print_trace(rows: list[dict]) -> None:
    """Each rank's timeline of the last repetition, ms from the variant's earliest start."""
    last = max(r["rep"] for r in rows)
    mine = [r for r in rows if r["rep"] == last]
    zero = {v: min(r["events"][0][2] for r in mine if r["variant"] == v) for v in {r["variant"] for r in mine}}
    for r in sorted(mine, key=lambda r: (r["variant"], r["rank"])):
        merged: list[list] = []
        for what, j, t0, t1 in r["events"]:
            t0, t1 = t0 - zero[r["variant"]], t1 - zero[r["variant"]]
            if merged and merged[-1][0] == what and merged[-1][1] == j and t0 - merged[-1][3] < 2e-3:
                merged[-1][3] = t1
            else:
                merged.append([what, j, t0, t1])
        cells = " ".join(f"{w}{j}[{t0 * 1e3:.0f}-{t1 * 1e3:.0f}]" for w, j, t0, t1 in merged if t1 - t0 > 5e-4)
        print(f"{r['variant']:>10} rank {r['rank']} step {r['step_s']:.3f}: {cells}")


def print_summary(res: dict) -> None:
    print(f"\n== pp {res['pp']} × dp {res['dp']}, {res['link']} ==")
    print(f"{'variant':>10} {'step s':>8} | per stage: exposed s / hidden s / wait s / peak saved MiB")
    for variant, v in res["variants"].items():
        cells = "  ".join(f"s{s}: {x['exposed_recompute_s']:.3f}/{x['hidden_recompute_s']:.3f}/{x['wait_s']:.3f}/"
                          f"{x['peak_saved_bytes'] / 2**20:.2f}" for s, x in v["stages"].items())
        print(f"{variant:>10} {v['step_s']:>8.3f} | {cells}")
    print("ratios (median of per-repetition ratios [quartiles]; ratio of medians):")
    for name, r in res["ratios"].items():
        print(f"  {name:>22} = {r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]; {r['of_medians']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="150,60",
                    help="link rate in Mbit/s per entry of --dps (on 2 cores a dp-2 rank shares its core with "
                         "its stage's other replica, so computes about half as fast: a lower rate keeps "
                         "transfer / compute comparable)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dps", default="1,2")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--optimizer", default="lion", choices=("allreduce", "lion"),
                    help="data-parallel sync: allreduce (mean of gradients, AdamW's) or DistributedLion (1 bit)")
    ap.add_argument("--plan", default="hand", help="a solver for Lynx's plan (opt, heu), or 'hand' (Megatron-full "
                    "drops, the stage's last layer in every gradient window)")
    ap.add_argument("--nice", type=int, default=-10, help="niceness increment of the ranks (negative needs root)")
    ap.add_argument("--trace", action="store_true", help="print each rank's timeline of the last repetition")
    ap.add_argument("--out", default="overlap_cpu.json", help="results file under benchmarks/results/")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--plan-worker", action="store_true")
    ap.add_argument("--spec")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.plan_worker:
        spec = json.loads(Path(args.spec).read_text())
        _renice(spec["nice"])
        if spec["solver"] == "hand":
            plan = make_schedules(spec["pp"], spec["microbatches"])
        else:
            plan = lynx_plan(spec["pp"], spec["microbatches"], spec["schedule"], spec["rate_mbit"], spec["solver"])
        Path(args.spec).write_text(json.dumps({"plan": [plan, stage_costs(plan[0], plan[1])]}))
        return
    from lynx.testbed import NetBed, measure_link

    dps = [int(x) for x in args.dps.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    rates = rates if len(rates) == len(dps) else [rates[0]] * len(dps)
    # Plan and stage costs in a session of their own, niced like the ranks: measured times see
    # fewer of the other jobs on the machine.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"pp": args.pp, "microbatches": args.microbatches, "schedule": args.schedule,
                   "rate_mbit": rates[0], "solver": args.plan, "nice": args.nice}, f)
    subprocess.run([sys.executable, __file__, "--plan-worker", "--spec", f.name], check=True,
                   start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (nodes, schedules, source), costs = json.loads(Path(f.name).read_text())["plan"]
    os.unlink(f.name)
    print(f"model: GPT {CFG}, microbatch {MICROBATCH}, {args.microbatches} microbatches, {args.schedule}")
    print(f"plan: {source}")
    for s, c in enumerate(costs["stages"]):
        print(f"stage {s}, one microbatch, 1 thread, CPU time: forward {c['forward_ms']:.1f} ms, backward "
              f"{c['backward_ms']:.1f} ms, recompute of its drops {c['recompute_ms']:.1f} ms")
    results = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_start": os.getloadavg(),
               "cores": len(os.sched_getaffinity(0)), "schedule": args.schedule, "microbatches": args.microbatches,
               "reps": args.reps, "optimizer": args.optimizer, "nice": args.nice, "model": CFG, "microbatch": MICROBATCH,
               "plan": source, "stage_costs": costs, "runs": []}
    for dp, rate in zip(dps, rates):
        world = args.pp * dp
        spec = {"pp": args.pp, "dp": dp, "nodes": nodes, "schedules": schedules, "microbatches": args.microbatches,
                "schedule": args.schedule, "reps": args.reps, "trace": args.trace, "optimizer": args.optimizer, "nice": args.nice}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        load = os.getloadavg()
        with NetBed(world_size=world, rate_mbit=rate) as bed:
            limited = bed.rate_limited  # read inside: a closed bed reports False
            link = measure_link(bed) if limited else None
            transfer_ms = costs["boundary_bytes"] * 8 / (link.measured_mbit * 1e3) if link else 0.0
            c0 = costs["stages"][0]
            print(f"\nbed: {world} ranks, rate-limited={limited}, " + (f"{link}" if link else f"({bed.fallback_reason})")
                  + f"; boundary {costs['boundary_bytes'] / 1024:.0f} KiB = {transfer_ms:.1f} ms each way "
                  f"({transfer_ms / (c0['forward_ms'] + c0['backward_ms']):.0%} of stage 0's forward+backward "
                  f"on a core of its own)")
            out = bed.run([sys.executable, __file__, "--worker", "--spec", f.name],
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout_s=1800)
        os.unlink(f.name)
        line = next(ln for ln in out[0].stdout.splitlines() if ln.startswith("LYNX_RESULT "))
        rows = json.loads(line[len("LYNX_RESULT "):])
        if args.trace:
            print_trace(rows)
        res = summarize(rows, args.pp, dp)
        if args.pp == 2 and args.schedule == "1f1b" and transfer_ms:
            res["ideal_ms"] = ideal_steps(costs, transfer_ms, args.microbatches, slowdown=2.0 if world > len(
                os.sched_getaffinity(0)) else 1.0)
        res.update(rate_mbit=rate, rate_limited=limited, link=str(link) if link else "loopback, not limited",
                   transfer_ms=transfer_ms, loadavg_start=load, loadavg_end=os.getloadavg())
        print_summary(res)
        if "ideal_ms" in res:
            print("no-noise model of these costs and this rate (ms): " + ", ".join(
                f"{k} {v:.3f}" if "/" in k else f"{k} {v:.0f}" for k, v in res["ideal_ms"].items()))
        print(f"load average (1, 5, 15 min): {load} at start, {res['loadavg_end']} at end")
        results["runs"].append(res)
    results["loadavg_end"] = os.getloadavg()
    path = ROOT / "benchmarks" / "results" / args.out
    path.write_text(json.dumps(results, indent=1))
    print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
