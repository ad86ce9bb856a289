"""``lynx calibrate``: measure this host into a :class:`~lynx.planner.hardware.HardwareSpec`.

On CPU it measures what ``cpu-local`` holds (one thread per rank, as ``examples/train_gpt.py``
runs): matmul and elementwise rates, eager op overhead, random numbers, optimizer steps
(:mod:`lynx.calibrate.cpu`) and the gloo link between two processes of this host
(:mod:`lynx.calibrate.links`), which pp, tp and dp all use here. With CUDA it measures the
first GPU instead (:mod:`lynx.calibrate.gpu`) and the NCCL link between the first two GPUs; with
one GPU no link can be seen, so the links are a datasheet preset's (named in the notes). Every
quantity is measured ``repeats`` times; the spec holds the medians and its ``calibration``
block the spread, the time taken and the load average before and after.

Example (about 20 s on 2 cores; ``lynx calibrate`` runs it)::

    >>> from lynx.calibrate import calibrate_host
    >>> spec = calibrate_host(progress=False, repeats=1)              # doctest: +SKIP
    >>> spec.device, spec.calibration.repeats                          # doctest: +SKIP
    ('cpu', 1)
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch

from lynx.calibrate.repeats import Repeated
from lynx.errors import LynxRuntimeError
from lynx.planner.hardware import HARDWARE_PRESETS, Calibration, HardwareSpec, LinkSpec

__all__ = ["calibrate_host"]


def calibrate_host(progress: bool = True, repeats: int = 5, device: str | None = None) -> HardwareSpec:
    """Measure this host (``device``: ``"cpu"``, ``"cuda"``, default CUDA where present)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise LynxRuntimeError("calibrate measures one rank alone, so it needs a process without a process group: "
                               "run `lynx calibrate` or `python -m lynx.calibrate --output FILE` instead")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LynxRuntimeError("--device cuda: torch sees no CUDA device here (a CPU-only torch build, or no GPU "
                               "visible); measure the CPU with --device cpu")
    say = _Progress(progress)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    threads = torch.get_num_threads()
    try:
        fields, measured, notes, used_threads = (_measure_cpu if device == "cpu" else _measure_gpu)(repeats, say)
    finally:
        torch.set_num_threads(threads)
        say.close()
    calibration = Calibration(
        host=socket.gethostname(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - start, 2), repeats=repeats, threads=used_threads, cpus=os.cpu_count() or 1,
        load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2), torch=torch.__version__,
        spread={m.name: round(m.spread, 4) for m in measured}, notes=notes)
    return HardwareSpec(**fields, calibration=calibration)


# ------------------------------------------------------------------------------- CPU
def _measure_cpu(repeats: int, say: "_Progress") -> tuple[dict[str, Any], list[Repeated], list[str], int]:
    from lynx.calibrate.cpu import OPTIMIZERS, ReferenceModel, generated_graphs_s, generated_op_overhead_s
    from lynx.calibrate.cpu import matmul_dtype_ratios, node_rates, op_overhead_s
    from lynx.calibrate.cpu import optimizer_s_per_param
    from lynx.calibrate.host_copies import memcpy_link
    from lynx.calibrate.links import measure_link

    say.total(2 + repeats)
    say.step("gloo link between two processes (α: 1-element round trips, β: 16 MiB)")
    alphas, betas = measure_link("gloo", repeats=repeats)  # first: the workers fork before any thread pool exists
    torch.set_num_threads(1)
    say.step("capturing the reference model (gpt-tiny, seq 64 × 8)")
    reference = ReferenceModel()
    m = {name: Repeated(name) for name in (
        "op_overhead_s", "peak_flops.float32", "peak_flops.bfloat16", "peak_flops.float16", "memory_bandwidth",
        "rng_s_per_element", *(f"optimizer_s_per_param.{o}" for o in OPTIMIZERS), *_HOST_LINK)}
    graphs_s: list[float] = []
    eager_overheads: list[float] = []
    for r in range(repeats):
        say.step(f"repeat {r + 1} of {repeats}: "
                 "op overhead, gpt-tiny's nodes and generated graphs, matmul dtypes, optimizer steps")
        overhead = op_overhead_s()
        eager_overheads.append(overhead)
        rates = node_rates(reference, overhead)
        ratios = matmul_dtype_ratios()
        steps = optimizer_s_per_param(reference)
        graphs_s.append(generated_graphs_s(reference))
        m["peak_flops.float32"].values.append(rates["matmul_flops"])
        m["memory_bandwidth"].values.append(rates["memory_bandwidth"])
        m["rng_s_per_element"].values.append(rates["rng_s_per_element"])
        for dtype in ("bfloat16", "float16"):
            m[f"peak_flops.{dtype}"].values.append(rates["matmul_flops"] * ratios[dtype])
        for name in OPTIMIZERS:
            m[f"optimizer_s_per_param.{name}"].values.append(steps[name])
        for name, value in memcpy_link().items():
            m[f"host_link.{name}"].values.append(value)
    # the generated code's per-op cost on the median rates: its spread is the timing's alone
    rates = {"matmul_flops": m["peak_flops.float32"].median, "memory_bandwidth": m["memory_bandwidth"].median,
             "rng_s_per_element": m["rng_s_per_element"].median}
    eager = statistics.median(eager_overheads)
    m["op_overhead_s"].values.extend(generated_op_overhead_s(reference, rates, t, floor_s=eager) for t in graphs_s)
    link = LinkSpec(alpha_s=statistics.median(alphas), beta_bytes_per_s=statistics.median(betas))
    fields = {
        "name": f"{socket.gethostname()}-cpu", "device": "cpu",
        "peak_flops": {d: m[f"peak_flops.{d}"].median for d in ("float32", "bfloat16", "float16")},
        "achievable_fraction": 1.0, "memory_bandwidth": m["memory_bandwidth"].median,
        "memory_bytes": _physical_memory(), "links": {"pp": link, "tp": link, "dp": link},
        "op_overhead_s": m["op_overhead_s"].median, "rng_s_per_element": m["rng_s_per_element"].median,
        "optimizer_s_per_param": {o: m[f"optimizer_s_per_param.{o}"].median for o in OPTIMIZERS},
        "host_link": {**{k.split(".", 1)[1]: m[k].median for k in _HOST_LINK}, "synchronous": True},
        "host_memory_bytes": _physical_memory() // 2,
    }
    measured = [*m.values(), Repeated("links.alpha_s", alphas), Repeated("links.beta_bytes_per_s", betas)]
    notes = ["one thread per process, as a training rank runs; rates fitted to gpt-tiny's own nodes",
             "op overhead: per op of the generated graphs, fitted on gpt-tiny compiled as one stage (4 in flight)",
             "links: gloo between two processes of this host; pp, tp and dp all use it",
             "bfloat16/float16 matmul: float32's fitted rate × their speed on a (512, 128) @ (128, 512) matmul",
             "host link (offload): one thread copying 64 MiB between two buffers; host memory: half the RAM"]
    return fields, measured, notes, 1


# ------------------------------------------------------------------------------- GPU
def _measure_gpu(repeats: int, say: "_Progress") -> tuple[dict[str, Any], list[Repeated], list[str], int]:
    from lynx.calibrate.gpu import device_memory_bytes, launch_overhead_s, matmul_flops, memory_bandwidth
    from lynx.calibrate.host_copies import pinned_link
    from lynx.calibrate.links import measure_link

    gpus = torch.cuda.device_count()
    say.total(repeats + (1 if gpus >= 2 else 0))
    notes = []
    links_measured = None
    if gpus >= 2:
        say.step("NCCL link between GPU 0 and GPU 1")
        alphas, betas = measure_link("nccl", repeats=repeats)
        links_measured = (alphas, betas)
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    m = {n: Repeated(n) for n in ("peak_flops.float32", "peak_flops.bfloat16", "peak_flops.float16",
                                  "memory_bandwidth", "op_overhead_s", *_HOST_LINK)}
    for r in range(repeats):
        say.step(f"repeat {r + 1} of {repeats}: matmul per dtype, memory bandwidth, launch overhead on {name}")
        for dtype, rate in matmul_flops(device).items():
            m[f"peak_flops.{dtype}"].values.append(rate)
        m["memory_bandwidth"].values.append(memory_bandwidth(device))
        m["op_overhead_s"].values.append(launch_overhead_s(device))
        for key, value in pinned_link(device).items():
            m[f"host_link.{key}"].values.append(value)
    measured = list(m.values())
    if links_measured is not None:
        link = LinkSpec(alpha_s=statistics.median(links_measured[0]),
                        beta_bytes_per_s=statistics.median(links_measured[1]))
        links = {"pp": link, "tp": link, "dp": link}
        measured += [Repeated("links.alpha_s", links_measured[0]),
                     Repeated("links.beta_bytes_per_s", links_measured[1])]
        notes.append(
            "links: NCCL between GPU 0 and GPU 1 of this host for pp, tp and dp; links to other hosts "
            "are not visible from here: describe them in a cluster file (docs/hardware.md)"
        )
    else:
        preset = _closest_preset(name)
        links = dict(HARDWARE_PRESETS[preset].links)
        notes.append(f"links: one GPU visible, nothing to measure between; taken from the {preset!r} preset")
    fields = {
        "name": f"{socket.gethostname()}-{name.replace(' ', '-').lower()}",
        "device": "cuda",
        "peak_flops": {d: m[f"peak_flops.{d}"].median for d in ("float32", "bfloat16", "float16")},
        "achievable_fraction": 1.0,
        "memory_bandwidth": m["memory_bandwidth"].median,
        "memory_bytes": device_memory_bytes(device),
        "links": links,
        "op_overhead_s": m["op_overhead_s"].median,
        "host_link": {k.split(".", 1)[1]: m[k].median for k in _HOST_LINK},
        "host_memory_bytes": _physical_memory() // max(1, gpus) // 2,
    }
    notes.append(f"GPU 0: {name}; float32 matmul with allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
    notes.append("host link (offload): pinned 256 MiB copies each way on a side stream, 4 KiB for the latency; "
                 "host memory: half of the RAM's share per GPU")
    return fields, measured, notes, torch.get_num_threads()


_HOST_LINK = ("host_link.alpha_s", "host_link.d2h_bytes_per_s", "host_link.h2d_bytes_per_s")


def _closest_preset(gpu_name: str) -> str:
    lowered = gpu_name.lower()
    for key, preset in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g")):
        if key in lowered:
            return preset
    return "a100-pcie-box"


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


class _Progress:
    """Progress on stderr: a rich bar on a terminal, a line per step otherwise."""

    def __init__(self, active: bool) -> None:
        self.active, self.bar, self.task, self.count, self.n = active, None, None, 0, 0
        self.started = time.perf_counter()

    def total(self, n: int) -> None:
        self.n = n
        if self.active and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("calibrate"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=n)

    def step(self, what: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=self.count, description=what)
        else:
            print(
                f"calibrate [{self.count + 1}/{self.n}] {time.perf_counter() - self.started:5.1f} s  {what}",
                file=sys.stderr,
                flush=True,
            )
        self.count += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
