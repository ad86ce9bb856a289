"""Overlapped vs on-demand recomputation, measured on real processes over rate-limited links.

Runs a GPT over ``pp`` × ``dp`` CPU ranks (one thread each) in the test bed's network
namespaces (``lynx.testbed.NetBed``: veth links limited with ``tc tbf``), 8 microbatches per
step, and in the same processes and run alternates three variants step by step:

* ``none``       keep every saved tensor (no recomputation; needs the most memory);
* ``on-demand``  drop the plan's nodes and recompute them when backward unpacks them — the
                 ``torch.utils.checkpoint`` (non-reentrant) mechanism on the same kept set;
* ``lynx``       the same drops, recomputed in the plan's windows while the gradient is on
                 the wire (whatever a window cannot hold stays on demand).

It prints, per topology, the median step time of each variant and the ratios, the exposed
and hidden recompute and the measured peak saved-activation bytes per stage, the link rate
and what a boundary transfer costs next to a stage's compute. Results go to
``benchmarks/results/overlap_cpu.json``.

Usage::

    python benchmarks/overlap_cpu.py                 # pp 2 and pp 2 × dp 2, 8 microbatches
    python benchmarks/overlap_cpu.py --rate-mbit 50 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx.models import GPT, GPTConfig  # noqa: E402

CFG = dict(vocab_size=2048, seq_len=128, hidden=256, heads=4, layers=2, dropout=0.1)
MICROBATCH = 2


def build_model() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    idx = torch.randint(0, CFG["vocab_size"], (MICROBATCH, CFG["seq_len"]))  # (B, T)
    return model, (idx, idx.roll(-1, dims=1))


# ----------------------------------------------------------------------------- planning
def lynx_plan(pp: int, microbatches: int, schedule: str, rate_mbit: float, solver: str = "heu"):
    """Lynx's plan for this model: the pp link at the bed's rate, a budget that makes the first
    stage (most microbatches in flight) recompute while the last one fits."""
    import lynx
    from lynx.hardware import LinkSpec, get_hardware
    from lynx.rewrite.build import stage_node_lists

    model, inputs = build_model()
    base = get_hardware("cpu-local")
    link = LinkSpec(alpha_s=1e-3, beta_bytes_per_s=rate_mbit * 1e6 / 8)
    hw = base.model_copy(update={"links": {**base.links, "pp": link, "dp": link}})
    common = dict(pp=pp, microbatches=microbatches, schedule=schedule, hardware=hw, target="cpu")
    keep = lynx.compile(model, inputs, solver="none", memory_budget="20GiB", **common).plan
    first, last = keep.stages[0], keep.stages[-1]
    budget = max(first.static_bytes + int(0.6 * first.activation_bytes), last.static_bytes + last.activation_bytes)
    plan = lynx.compile(model, inputs, solver=solver, memory_budget=budget, **common).plan
    nodes = stage_node_lists(plan)
    schedules = []
    for s in range(pp):
        sched = plan.stage_schedule(s)
        schedules.append({"dropped": sorted(sched.dropped),
                          "prefetch": {j: [(w, list(n)) for w, n in v] for j, v in sched.prefetch.items()}})
    return nodes, schedules, (f"lynx.compile(solver={solver!r}, memory_budget={budget} B): status {plan.status}, "
                              f"predicted step {plan.predicted.step_time_s:.3f} s, exposed "
                              f"{plan.predicted.exposed_recompute_s:.3f} s, hidden {plan.predicted.hidden_recompute_s:.3f} s")


def make_schedules(pp: int, microbatches: int) -> tuple[list[list[str]], list[dict], str]:
    """A hand-made plan of the solvers' shape (Megatron-full drops on all but the last stage,
    the stage's last layer in each recv_grad window), for when the planner cannot be used."""
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
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from lynx.capture import capture
    from lynx.plan import StageSchedule
    from lynx.rewrite.build import split_cached
    from lynx.rewrite.stage import StageModule
    from lynx.runtime.launch import TokenBatches, rank_seed
    from lynx.runtime.pipeline import PipelineRunner, RuntimeConfig
    from lynx.runtime.topology import make_topology

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ["RANK"]) % len(cores)]})  # one core per rank, when there are enough
    spec = json.loads(Path(args.spec).read_text())
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
    keep_all = StageModule(parts[s])
    dropping = StageModule(parts[s], schedule.dropped)
    m = spec["microbatches"]
    base = dict(schedule=spec["schedule"], microbatches=m, timeout_s=300, bucket_bytes=256 << 10)
    runners = {
        "none": PipelineRunner(keep_all, topo, RuntimeConfig(**base)),
        "on-demand": PipelineRunner(dropping, topo, RuntimeConfig(**base, prefetch=False), schedule=schedule),
        "lynx": PipelineRunner(dropping, topo, RuntimeConfig(**base), schedule=schedule),
    }
    batches = TokenBatches(tuple(captured.input_names), CFG["vocab_size"], MICROBATCH, CFG["seq_len"])
    torch.manual_seed(rank_seed(0, s, topo.dp_rank))
    rows = []
    for rep in range(spec["reps"] + 1):  # rep 0 warms up
        for variant in (("none", "on-demand", "lynx") if rep % 2 == 0 else ("lynx", "on-demand", "none")):
            dist.barrier()
            stats = runners[variant].step(batches(rep, topo.dp_rank, m))
            if rep > 0:
                rows.append({"variant": variant, "rep": rep, **stats.as_dict()})
    gathered: list = [None] * topo.world
    dist.all_gather_object(gathered, rows)
    if topo.rank == 0:
        print("LYNX_RESULT " + json.dumps([r for rank_rows in gathered for r in rank_rows]))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver
def stage_costs(nodes: list[list[str]]) -> tuple[float, float, int]:
    """Single-thread forward+backward seconds of stage 0 for one microbatch, and boundary bytes."""
    from lynx.capture import capture
    from lynx.rewrite.build import split_cached
    from lynx.rewrite.stage import StageModule

    torch.set_num_threads(1)
    model, inputs = build_model()
    captured = capture(model, inputs)
    part = split_cached(captured.gm, nodes)[0]
    stage = StageModule(part)
    batch = dict(zip(captured.input_names, inputs))
    times = []
    for j in range(4):
        t0 = time.perf_counter()
        out = stage(*[batch[n] for n in stage.spec.inputs], microbatch=j)
        t1 = time.perf_counter()
        torch.autograd.backward(list(out), [torch.ones_like(o) for o in out])
        t2 = time.perf_counter()
        stage.release(j)
        times.append((t1 - t0, t2 - t1))
    fwd = statistics.median(t[0] for t in times)
    bwd = statistics.median(t[1] for t in times)
    nbytes = sum(o.numel() * o.element_size() for o in out)
    return fwd, bwd, nbytes


def summarize(rows: list[dict], pp: int, dp: int) -> dict:
    out: dict = {"pp": pp, "dp": dp, "variants": {}}
    for variant in ("none", "on-demand", "lynx"):
        mine = [r for r in rows if r["variant"] == variant]
        reps = sorted({r["rep"] for r in mine})
        step = statistics.median(max(r["step_s"] for r in mine if r["rep"] == k) for k in reps)
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
        out["variants"][variant] = {"step_s": step, "stages": per_stage}
    v = out["variants"]
    out["lynx_over_on_demand"] = v["lynx"]["step_s"] / v["on-demand"]["step_s"]
    out["lynx_over_none"] = v["lynx"]["step_s"] / v["none"]["step_s"]
    out["on_demand_over_none"] = v["on-demand"]["step_s"] / v["none"]["step_s"]
    return out


def print_summary(res: dict) -> None:
    print(f"\n== pp {res['pp']} × dp {res['dp']} ==")
    print(f"{'variant':>10} {'step s':>8} | per stage: exposed s / hidden s / wait s / peak saved MiB")
    for variant, v in res["variants"].items():
        cells = "  ".join(f"s{s}: {x['exposed_recompute_s']:.3f}/{x['hidden_recompute_s']:.3f}/{x['wait_s']:.3f}/"
                          f"{x['peak_saved_bytes'] / 2**20:.2f}" for s, x in v["stages"].items())
        print(f"{variant:>10} {v['step_s']:>8.3f} | {cells}")
    print(f"lynx / on-demand = {res['lynx_over_on_demand']:.3f}   lynx / none = {res['lynx_over_none']:.3f}   "
          f"on-demand / none = {res['on_demand_over_none']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dps", default="1,2")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--plan", default="heu", help="solver for Lynx's plan (heu, opt) or 'hand'")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--spec")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from lynx.testbed import NetBed, measure_link

    if args.plan == "hand":
        nodes, schedules, source = make_schedules(args.pp, args.microbatches)
    else:
        nodes, schedules, source = lynx_plan(args.pp, args.microbatches, args.schedule, args.rate_mbit, args.plan)
    fwd, bwd, nbytes = stage_costs(nodes)
    transfer_s = nbytes * 8 / (args.rate_mbit * 1e6)
    print(f"model: GPT {CFG}, microbatch {MICROBATCH}, {args.microbatches} microbatches, {args.schedule}")
    print(f"plan: {source}")
    print(f"stage 0, one microbatch, 1 thread: forward {fwd * 1e3:.1f} ms, backward {bwd * 1e3:.1f} ms; "
          f"boundary {nbytes / 1024:.0f} KiB = {transfer_s * 1e3:.1f} ms at {args.rate_mbit:g} Mbit/s "
          f"({transfer_s / (fwd + bwd):.0%} of the stage's compute, each way)")
    results = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_start": os.getloadavg(),
               "schedule": args.schedule, "microbatches": args.microbatches, "reps": args.reps,
               "rate_mbit": args.rate_mbit, "model": CFG, "microbatch": MICROBATCH, "plan": source,
               "stage0_forward_s": fwd, "stage0_backward_s": bwd, "boundary_bytes": nbytes, "runs": []}
    for dp in [int(x) for x in args.dps.split(",")]:
        world = args.pp * dp
        spec = {"pp": args.pp, "dp": dp, "nodes": nodes, "schedules": schedules, "microbatches": args.microbatches,
                "schedule": args.schedule, "reps": args.reps}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        with NetBed(world_size=world, rate_mbit=args.rate_mbit) as bed:
            link = measure_link(bed) if bed.rate_limited else None
            print(f"\nbed: {world} ranks, rate-limited={bed.rate_limited}"
                  + (f", {link}" if link else f" ({bed.fallback_reason})"))
            out = bed.run([sys.executable, __file__, "--worker", "--spec", f.name],
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout_s=1800)
        os.unlink(f.name)
        line = next(ln for ln in out[0].stdout.splitlines() if ln.startswith("LYNX_RESULT "))
        res = summarize(json.loads(line[len("LYNX_RESULT "):]), args.pp, dp)
        res["rate_limited"] = bed.rate_limited
        res["link"] = str(link) if link else None
        print_summary(res)
        results["runs"].append(res)
    results["loadavg_end"] = os.getloadavg()
    print(f"\nload average (1, 5, 15 min) at start {results['loadavg_start']}, at end {results['loadavg_end']}")
    for name in ("overlap_cpu.json", time.strftime("overlap_cpu_%H%M.json", time.gmtime())):
        path = ROOT / "benchmarks" / "results" / name
        path.write_text(json.dumps(results, indent=1))
        print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
