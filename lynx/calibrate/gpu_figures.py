"""``lynx calibrate`` with CUDA: the first GPU's figures, and the NCCL link to a second one.

Per repeat: matmul rates per dtype, memory bandwidth, the launch overhead of an op, pinned host
copies each way (:mod:`lynx.calibrate.gpu`, :mod:`lynx.calibrate.host_copies`); with two GPUs
the NCCL link between them (:mod:`lynx.calibrate.links`), with one a datasheet preset's links
(named in the notes). :func:`lynx.calibrate.host.calibrate_host` calls :func:`measure_gpu`.
"""

from __future__ import annotations

import socket
import statistics
from typing import Any

import torch

from lynx.calibrate.host_copies import HOST_LINK_FIGURES, physical_memory
from lynx.calibrate.progress import CalibrationProgress
from lynx.calibrate.repeats import Repeated
from lynx.planner.hardware import HARDWARE_PRESETS, LinkSpec

__all__ = ["measure_gpu"]


def measure_gpu(repeats: int, say: "CalibrationProgress") -> tuple[dict[str, Any], list[Repeated], list[str], int]:
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
                                  "memory_bandwidth", "op_overhead_s", *HOST_LINK_FIGURES)}
    for r in range(repeats):
        say.step(f"repeat {r + 1} of {repeats}: matmul per dtype, memory bandwidth, launch overhead on {name}")
        for dtype, rate in matmul_flops(device).items():
            m[f"peak_flops.{dtype}"].add(rate)
        m["memory_bandwidth"].add(memory_bandwidth(device))
        m["op_overhead_s"].add(launch_overhead_s(device))
        for key, value in pinned_link(device).items():
            m[f"host_link.{key}"].add(value)
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
        "host_link": {k.split(".", 1)[1]: m[k].median for k in HOST_LINK_FIGURES},
        "host_memory_bytes": physical_memory() // max(1, gpus) // 2,
    }
    notes.append(f"GPU 0: {name}; float32 matmul with allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
    notes.append("host link (offload): pinned 256 MiB copies each way on a side stream, 4 KiB for the latency; "
                 "host memory: half of the RAM's share per GPU")
    return fields, measured, notes, torch.get_num_threads()


def _closest_preset(gpu_name: str) -> str:
    lowered = gpu_name.lower()
    for key, preset in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g")):
        if key in lowered:
            return preset
    return "a100-pcie-box"
