"""Calibrate the ``cpu-local`` hardware preset on this machine, one thread per rank.

Measures what the analytic cost model needs to predict a CPU training step of a small model
run by Lynx's compiled stages:

* the fixed cost of one eager op;
* matmul FLOP/s, elementwise bandwidth and the cost of one random number (dropout's mask: on
  a CPU this, not memory, bounds dropout), fitted to the forward times of ``gpt-tiny``'s own
  nodes at ``examples/train_gpt.py``'s shapes (seq 64 × 8), and checked on its backward;
* the compiled stage's host cost per graph node beyond eager (:class:`lynx.rewrite.StageModule`
  runs generated code; reported as a check that it stays near zero, the model has no such term);
* one optimizer step per parameter for AdamW, DeMo and DistributedLion (one rank, on the
  parameters of ``gpt-tiny``; per-tensor overheads are folded into the per-parameter figure);
* gloo send/recv latency and bandwidth between two processes on loopback.

Prints the measured values beside the preset's (``--json PATH`` also writes them). Run it on
a quiet machine (``flock /work/notes/bench.lock`` where others share it) and copy the figures
into ``lynx/planner/hardware.py``.

    python benchmarks/calibrate_cpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lynx.planner.hardware import HARDWARE_PRESETS


def _best(fn, repeats: int = 15) -> float:
    """The fastest of ``repeats`` runs: on a shared machine, the run least disturbed by others."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def op_overhead() -> float:
    x = torch.randn(4)
    reps = 2000
    return _best(lambda: [x.add(1.0) for _ in range(reps)]) / reps


def _tiny_gpt():
    import lynx

    torch.manual_seed(0)
    resolved = lynx.models.resolve_model("gpt-tiny", seq=64, microbatch=8, device="cpu")
    analysis = lynx.analyze(resolved.model, resolved.example_inputs, target="cpu")
    return resolved, analysis


def node_rates(analysis, overhead: float) -> dict[str, float]:
    """Matmul FLOP/s, elementwise bandwidth and seconds per random number, fitted to the
    forward times of gpt-tiny's own nodes (``lynx.frontend.measure.measure_times``: every node timed for
    real, its output kept as in a forward), each less the eager op overhead.

    Microbenchmarks that discard each result hit the cache and overstate both rates 1.5-5×;
    in a forward the activations are fresh memory, so the model's own ops are the reference.
    """
    from lynx.calibrate.cpu import fit_node_rates
    from lynx.frontend.measure import measure_times

    rates = fit_node_rates(measure_times(analysis.graph.copy(), analysis.captured, repeats=9, statistic=min), overhead)
    return {"matmul_flops": rates["matmul_flops"], "bandwidth": rates["memory_bandwidth"],
            "rng_s_per_element": rates["rng_s_per_element"]}


def stage_extra_per_node(resolved, analysis) -> float:
    """Seconds a compiled stage adds per node over eager: gpt-tiny's forward as one
    :class:`lynx.rewrite.StageModule` (dropping nothing) less the eager forward, per node."""
    from lynx.rewrite import StageModule, split_graph
    from lynx.rewrite.split import op_nodes

    gm = analysis.captured.gm
    stage = StageModule(split_graph(gm, [[n.name for n in op_nodes(gm)]])[0])
    inputs = resolved.example_inputs
    model = resolved.model

    def staged() -> None:
        stage(*inputs, microbatch=0)
        stage.release(0)   # forget the microbatch (the timing needs no backward)

    with torch.enable_grad():   # many short runs: the fastest of each is the undisturbed one
        extra = _best(staged, repeats=40) - _best(lambda: model(*inputs), repeats=40)
    return max(0.0, extra) / len(op_nodes(gm))


def backward_check(resolved, analysis, hw) -> tuple[float, float]:
    """(measured, modelled) seconds of gpt-tiny's backward: a check of the fitted rates."""
    from lynx.planner.cost import node_backward_s

    model, inputs = resolved.model, resolved.example_inputs

    def fwd_bwd() -> None:
        model(*inputs).backward()

    with torch.enable_grad():
        measured = _best(fwd_bwd) - _best(lambda: model(*inputs))
    modelled = sum(node_backward_s(attrs, hw, "float32") for _, attrs in analysis.graph.nodes(data=True))
    return measured, modelled


def optimizer_per_param() -> dict[str, float]:
    """Seconds per parameter of one optimizer step (one rank, gpt-tiny's parameters)."""
    import lynx
    from lynx.optim import DeMo, DistributedLion

    torch.manual_seed(0)
    model, _ = lynx.models.build_preset("gpt-tiny", device="cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    makers = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
              "demo": lambda: DeMo(params, lr=1e-3, process_group=None),
              "lion": lambda: DistributedLion(params, lr=1e-3, process_group=None)}
    out = {}
    for name, make in makers.items():
        opt = make()
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()   # state allocation
        out[name] = _best(opt.step) / count
    return out


def _gloo_worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for numel in (1, 4 * 2**20):
        buf = torch.zeros(numel)
        reps = 50 if numel == 1 else 5
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        results[numel] = (time.perf_counter() - start) / (2 * reps)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def gloo_link() -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    alpha = results[1]
    beta = 4 * 4 * 2**20 / max(results[4 * 2**20] - alpha, 1e-9)
    return alpha, beta


def measure() -> dict[str, float]:

    torch.set_num_threads(1)
    resolved, analysis = _tiny_gpt()
    out = {"op_overhead_s": op_overhead()}
    out.update(node_rates(analysis, out["op_overhead_s"]))
    out["stage_extra_node_s"] = min(stage_extra_per_node(resolved, analysis) for _ in range(4))
    out.update({f"optimizer_{k}_s_per_param": v for k, v in optimizer_per_param().items()})
    fitted = HARDWARE_PRESETS["cpu-local"].model_copy(update={
        "peak_flops": {"float32": out["matmul_flops"]}, "achievable_fraction": 1.0,
        "memory_bandwidth": out["bandwidth"], "op_overhead_s": out["op_overhead_s"]})
    out["backward_measured_s"], out["backward_modelled_s"] = backward_check(resolved, analysis, fitted)
    out["gloo_alpha_s"], out["gloo_beta"] = gloo_link()
    out["loadavg_1min"] = os.getloadavg()[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the measured values here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    m = measure()
    preset = HARDWARE_PRESETS["cpu-local"]
    opt = preset.optimizer_s_per_param
    rows = [
        ("fp32 matmul FLOP/s", m["matmul_flops"] / 1e9, preset.achievable_flops("float32") / 1e9, "G"),
        ("elementwise bandwidth", m["bandwidth"] / 1e9, preset.memory_bandwidth / 1e9, "GB/s"),
        ("eager op overhead", m["op_overhead_s"] * 1e6, preset.op_overhead_s * 1e6, "µs"),
        ("random number (dropout)", m["rng_s_per_element"] * 1e9, preset.rng_s_per_element * 1e9, "ns/element"),
        ("compiled stage over eager", m["stage_extra_node_s"] * 1e6, 0.0, "µs/node (not modelled)"),
        *[(f"{name} step", m[f"optimizer_{name}_s_per_param"] * 1e9, opt.get(name, 0.0) * 1e9, "ns/param")
          for name in ("adamw", "demo", "lion")],
        ("gpt-tiny backward, measured", m["backward_measured_s"] * 1e3, m["backward_modelled_s"] * 1e3,
         "ms (preset column: modelled with the measured rates)"),
        ("gloo p2p latency", m["gloo_alpha_s"] * 1e6, preset.links["pp"].alpha_s * 1e6, "µs"),
        ("gloo p2p bandwidth", m["gloo_beta"] / 1e9, preset.links["pp"].beta_bytes_per_s / 1e9, "GB/s"),
    ]
    print(f"{'measured on this machine (1 thread)':36s} {'measured':>10s} {'preset':>10s}")
    for label, measured, planned, unit in rows:
        print(f"{label:36s} {measured:10.2f} {planned:10.2f}  {unit}")
    print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)


if __name__ == "__main__":
    main()
