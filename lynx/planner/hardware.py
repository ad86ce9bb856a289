"""Hardware descriptions: compute, memory bandwidth and the three communication links.

A :class:`HardwareSpec` gives peak dense matmul FLOP/s per dtype with the fraction that is
achievable in practice, memory bandwidth and capacity, and per-link α (latency, seconds) and β
(bandwidth, bytes/s) for the pipeline (``pp``), tensor-parallel (``tp``) and data-parallel
(``dp``) groups. Presets are vendor datasheet numbers with typical achievable fractions.
``cpu-local`` is measured on this machine (``benchmarks/calibrate_cpu.py``) and adds what a CPU
run of Lynx's stage interpreter pays on the host: random numbers, the interpreter's cost per
node and the optimizer step (zero on the GPU presets, where they are small or overlap
asynchronous kernels).

Example::

    >>> from lynx.planner.hardware import get_hardware
    >>> h100 = get_hardware("h100-sxm")
    >>> h100.links["tp"].beta_bytes_per_s > h100.links["dp"].beta_bytes_per_s
    True
    >>> round(h100.achievable_flops("float16") / 1e12)
    593
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lynx.errors import LynxConfigError

__all__ = ["LinkSpec", "HardwareSpec", "HARDWARE_PRESETS", "get_hardware", "share_cores"]


class LinkSpec(BaseModel):
    """One communication link: time(n bytes) = alpha_s + n / beta_bytes_per_s."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    alpha_s: float = Field(ge=0.0)
    beta_bytes_per_s: float = Field(gt=0.0)


class HardwareSpec(BaseModel):
    """One device and its links; every rate is per device."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    device: Literal["cuda", "cpu"]
    peak_flops: dict[str, float]  # dtype name ("float16", "bfloat16", "float32") → dense FLOP/s
    achievable_fraction: float = Field(gt=0.0, le=1.0)
    memory_bandwidth: float = Field(gt=0.0)  # bytes/s
    memory_bytes: int = Field(gt=0)
    links: dict[str, LinkSpec]  # "pp", "tp", "dp"
    op_overhead_s: float = Field(default=0.0, ge=0.0)  # per-op dispatch cost not hidden by async launch
    # Host-bound costs a CPU run pays and a GPU hides (GPU presets: 0, not modelled):
    rng_s_per_element: float = Field(default=0.0, ge=0.0)   # one random number (dropout's mask)
    interpreter_node_s: float = Field(default=0.0, ge=0.0)  # the stage interpreter, per graph node run
    optimizer_s_per_param: dict[str, float] = Field(default_factory=dict)  # optimizer name -> step s/param

    @field_validator("links")
    @classmethod
    def _has_all_links(cls, links: dict[str, LinkSpec]) -> dict[str, LinkSpec]:
        missing = {"pp", "tp", "dp"} - set(links)
        if missing:
            raise ValueError(f"links needs entries for pp, tp and dp; missing {sorted(missing)}")
        return links

    def achievable_flops(self, dtype: str) -> float:
        """FLOP/s a real kernel sustains for ``dtype`` (falls back to float32's peak)."""
        peak = self.peak_flops.get(dtype, self.peak_flops.get("float32"))
        if peak is None:
            raise LynxConfigError(f"hardware {self.name!r} has no peak_flops for {dtype!r} or float32")
        return peak * self.achievable_fraction


_GiB = 1024**3


def _gpu(name: str, fp16: float, fp32: float, bw: float, mem_gib: int, nvlink: float, ib: float) -> HardwareSpec:
    return HardwareSpec(
        name=name,
        device="cuda",
        peak_flops={"float16": fp16, "bfloat16": fp16, "float32": fp32},
        achievable_fraction=0.6,
        memory_bandwidth=bw,
        memory_bytes=mem_gib * _GiB,
        links={
            # Pipeline stages usually span nodes (InfiniBand); tensor parallelism stays in NVLink.
            "pp": LinkSpec(alpha_s=10e-6, beta_bytes_per_s=ib),
            "tp": LinkSpec(alpha_s=5e-6, beta_bytes_per_s=nvlink),
            "dp": LinkSpec(alpha_s=20e-6, beta_bytes_per_s=ib),
        },
    )


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # A100 SXM 80GB: 312 TF fp16 dense, 19.5 TF fp32 (non-TF32), 2.0 TB/s HBM2e, NVLink3 300 GB/s
    # per direction, HDR InfiniBand 200 Gb/s = 25 GB/s per GPU.
    "a100-80g": _gpu("a100-80g", 312e12, 19.5e12, 2.0e12, 80, 300e9, 25e9),
    # H100 SXM: 989 TF fp16 dense, 67 TF fp32, 3.35 TB/s HBM3, NVLink4 450 GB/s per direction,
    # NDR InfiniBand 400 Gb/s = 50 GB/s per GPU.
    "h100-sxm": _gpu("h100-sxm", 989e12, 67e12, 3.35e12, 80, 450e9, 50e9),
    # H200: H100's compute with 141 GB HBM3e at 4.8 TB/s.
    "h200": _gpu("h200", 989e12, 67e12, 4.8e12, 141, 450e9, 50e9),
    # This machine's CPU cores, one thread per rank, gloo over loopback; measured by
    # `benchmarks/calibrate_cpu.py` (2026-12-03, fastest of many runs at load 4-7 on 2 cores):
    # matmul 114-119 GFLOP/s and elementwise 14-15 GB/s fitted to gpt-tiny's own nodes, 1.9 µs
    # per eager op, 4.7 ns per random number, 38 µs per node run by the stage interpreter, an
    # optimizer step of 6.0 (AdamW), 13 (DeMo) and 5.4 (Lion) ns per parameter; gloo p2p
    # 3.0 GB/s and 150 µs latency on a quiet machine (86 µs quiet, 1.2-1.6 ms under load).
    "cpu-local": HardwareSpec(
        name="cpu-local",
        device="cpu",
        peak_flops={"float32": 115e9, "bfloat16": 15e9, "float16": 5e9},
        achievable_fraction=1.0,
        memory_bandwidth=14e9,
        memory_bytes=24 * _GiB,
        links={
            "pp": LinkSpec(alpha_s=150e-6, beta_bytes_per_s=3.0e9),
            "tp": LinkSpec(alpha_s=150e-6, beta_bytes_per_s=3.0e9),
            "dp": LinkSpec(alpha_s=150e-6, beta_bytes_per_s=3.0e9),
        },
        op_overhead_s=1.9e-6,
        rng_s_per_element=4.7e-9,
        interpreter_node_s=38e-6,
        optimizer_s_per_param={"adamw": 6.0e-9, "demo": 13e-9, "lion": 5.4e-9},
    ),
}


def get_hardware(hardware: str | HardwareSpec) -> HardwareSpec:
    """Return a preset by name, or ``hardware`` itself when it already is a spec."""
    if isinstance(hardware, HardwareSpec):
        return hardware
    try:
        return HARDWARE_PRESETS[hardware]
    except (KeyError, TypeError):
        raise LynxConfigError(
            f"unknown hardware {hardware!r}; presets: {', '.join(HARDWARE_PRESETS)} "
            "(or pass a lynx.HardwareSpec)"
        ) from None


def share_cores(hw: HardwareSpec, ranks: int, cores: int) -> HardwareSpec:
    """``hw`` (a CPU spec, one core per rank) as each of ``ranks`` processes sees it on ``cores``.

    With more ranks than cores, a busy rank gets ``cores / ranks`` of a core: compute rates
    scale down and host costs up by that share (links are left as they are). A GPU spec, or
    no more ranks than cores, is returned unchanged.

    Example::

        >>> shared = share_cores(get_hardware("cpu-local"), ranks=4, cores=2)
        >>> shared.name, shared.interpreter_node_s == 2 * get_hardware("cpu-local").interpreter_node_s
        ('cpu-local-4on2', True)
    """
    if hw.device != "cpu" or ranks <= cores or cores < 1:
        return hw
    share = cores / ranks
    return hw.model_copy(update={
        "name": f"{hw.name}-{ranks}on{cores}",
        "peak_flops": {k: v * share for k, v in hw.peak_flops.items()},
        "memory_bandwidth": hw.memory_bandwidth * share,
        "op_overhead_s": hw.op_overhead_s / share,
        "rng_s_per_element": hw.rng_s_per_element / share,
        "interpreter_node_s": hw.interpreter_node_s / share,
        "optimizer_s_per_param": {k: v / share for k, v in hw.optimizer_s_per_param.items()},
    })
