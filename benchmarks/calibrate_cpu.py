"""Calibrate the ``cpu-local`` hardware preset on this machine, one thread per rank.

Measures what the analytic cost model needs: sustained fp32 matmul FLOP/s (the sizes a tiny
GPT uses), copy bandwidth, the fixed cost of one eager op, and gloo send/recv latency and
bandwidth between two processes on loopback. Prints the measured values beside the preset's.

    python benchmarks/calibrate_cpu.py
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lynx.hardware import HARDWARE_PRESETS


def _best(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(n: int = 256) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    reps = 20
    return 2 * n**3 * reps / _best(lambda: [a @ b for _ in range(reps)])


def copy_bandwidth(numel: int = 8 * 2**20) -> float:
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src))


def op_overhead() -> float:
    x = torch.randn(4)
    reps = 2000
    return _best(lambda: [x.add(1.0) for _ in range(reps)]) / reps


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


def main() -> None:
    torch.set_num_threads(1)
    preset = HARDWARE_PRESETS["cpu-local"]
    flops, bw, overhead = matmul_flops(), copy_bandwidth(), op_overhead()
    alpha, beta = gloo_link()
    print("measured on this machine (1 thread)         preset cpu-local")
    print(f"fp32 matmul FLOP/s   {flops / 1e9:10.1f} G        {preset.peak_flops['float32'] * preset.achievable_fraction / 1e9:10.1f} G")
    print(f"copy bandwidth       {bw / 1e9:10.2f} GB/s     {preset.memory_bandwidth / 1e9:10.2f} GB/s")
    print(f"eager op overhead    {overhead * 1e6:10.1f} µs       {preset.op_overhead_s * 1e6:10.1f} µs")
    print(f"gloo p2p latency     {alpha * 1e6:10.1f} µs       {preset.links['pp'].alpha_s * 1e6:10.1f} µs")
    print(f"gloo p2p bandwidth   {beta / 1e9:10.2f} GB/s     {preset.links['pp'].beta_bytes_per_s / 1e9:10.2f} GB/s")


if __name__ == "__main__":
    main()
