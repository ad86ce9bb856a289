"""Hardware descriptions: compute, memory bandwidth and the three communication links.

A :class:`HardwareSpec` gives peak dense matmul FLOP/s per dtype with the fraction that is
achievable in practice, memory bandwidth and capacity, and per-link α (latency, seconds) and β
(bandwidth, bytes/s) for the pipeline (``pp``), tensor-parallel (``tp``) and data-parallel
(``dp``) groups. Presets are vendor datasheet numbers with typical achievable fractions.
``cpu-local`` is measured on this machine (``benchmarks/calibrate_cpu.py``) and adds what a CPU
run pays on the host: random numbers and the optimizer step (zero on the GPU presets, where they
are small or overlap asynchronous kernels).

Example::

    >>> from lynx.planner.hardware import get_hardware
    >>> h100 = get_hardware("h100-sxm")
    >>> h100.links["tp"].beta_bytes_per_s > h100.links["dp"].beta_bytes_per_s
    True
    >>> round(h100.achievable_flops("float16") / 1e12)
    593
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypedDict

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer

from lynx.errors import LynxConfigError
from lynx.planner.host_link import HOST_MEMORY_PER_GPU, PCIE4_X16, PCIE5_X16, HostLinkSpec

__all__ = ["LinkSpec", "Calibration", "CoreShare", "HardwareSpec", "HARDWARE_PRESETS", "PHYSICAL_RANGES",
           "RELIABLE_SPREAD", "CALIBRATION_METHOD", "get_hardware", "share_cores"]

# What `lynx calibrate` measures and how, numbered; raised whenever a figure is measured anew or
# differently, so that `--hardware auto` measures a cached file of an older method again.
# 1: files without the field (before 2026-12-04); 2: the tp link from all-reduces inside a
# sharded stage, the runtime's own work per action; 3: the runtime's work timed inside the step
# (not a step less its graphs run alone), the pp link's ranks pinned to a core each, β the median;
# 4: the eager op, the dtype matmuls and the host copies timed in a process beside the first
# capture (lynx.calibrate.standalone), the TP stage 3 repeats of the fastest of 3 (was 5);
# 5: the links timed by the runtime's and the TP stage's ranks after their own measurement (no
# pair forked for them), β the median of twice as many repeats (10, each of 100 small trips);
# 6: β the best of those repeats, as α (the median followed the host's placement of the vCPUs);
# 7: the forked ranks' threads on 0.1 ms scheduler slices, as a CPU training rank's
# (lynx.runtime.sched_slice): the links and the TP stage's collectives timed as they then run;
# 8: the TP stage's run the median of 5 per repeat, not the fastest of 3 (its collectives' thread
# hand-offs spread its runs with nothing else running; every step pays the typical run's).
# 9: the TP stage's ranks on a core each, as lynx.runtime.Pipeline now keeps a TP CPU job's ranks that
# fill the cores (lynx.runtime.core_pin), and the median of 9 runs per repeat.
# 10: the TP stage's runs in a block of 5 after each of the 5 repeats (was 3 × 9 back to back at
# the end: what a collective costs moves with the moment), and the cpus other processes took.
CALIBRATION_METHOD = 10

# A measured figure is repeatable when every repeat is within ±10% of the repeats' median (for a
# best-of-repeats figure: its two best repeats within 10%); `lynx calibrate` flags the others.
RELIABLE_SPREAD = 0.10

# What a device or link can physically be, per field: (lowest, highest, unit). Far outside
# anything built (an H200 does ~1e15 dense FLOP/s and 4.8e12 B/s; NVLink 5 moves 9e11 B/s a
# direction), so a real figure is never refused, and a typo — 1e30, 1e-30, inf — is refused
# before it reaches the cost model (1e30 overflowed the solvers' integer scaling; 1e-30 FLOP/s
# predicted a step of 1e41 ms).
PHYSICAL_RANGES: dict[str, tuple[float, float, str]] = {
    "peak_flops": (1e6, 1e18, "FLOP/s"),
    "memory_bandwidth": (1e6, 1e15, "bytes/s"),
    "memory_bytes": (2**20, 2**50, "bytes"),
    "alpha_s": (0.0, 60.0, "s"),
    "beta_bytes_per_s": (1e3, 1e14, "bytes/s"),
    "op_overhead_s": (0.0, 1.0, "s"),
    "rng_s_per_element": (0.0, 1e-3, "s"),
    "optimizer_s_per_param": (0.0, 1e-3, "s"),
    "runtime_action_s": (0.0, 1.0, "s"),
    "host_s_per_byte": (0.0, 1e-6, "s/B"),
    "burst_s": (0.0, 60.0, "s"),
}


def _physical(field: str) -> Any:
    """A float type that is finite and inside ``PHYSICAL_RANGES[field]`` (a ValueError saying so)."""
    low, high, unit = PHYSICAL_RANGES[field]

    def check(value: float) -> float:
        if not low <= value <= high:
            raise ValueError(f"{value:g} {unit} is outside the physical range [{low:g}, {high:g}] {unit}")
        return value

    kind = int if field == "memory_bytes" else float
    return Annotated[kind, AfterValidator(check)]


class LinkSpec(BaseModel):
    """One communication link: time(n bytes) = alpha_s + n / beta_bytes_per_s."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    alpha_s: _physical("alpha_s")  # type: ignore[valid-type]
    beta_bytes_per_s: _physical("beta_bytes_per_s")  # type: ignore[valid-type]
    # CPU seconds each end's host loses per byte sent or received while the message flows (a
    # software-shaped link's kernel work on the ranks' own cores: lynx.testbed.host_probe); the
    # timeline charges it to the compute the message overlaps (lynx.planner.link_host)
    host_s_per_byte: _physical("host_s_per_byte") = 0.0  # type: ignore[valid-type]
    # a rate-shaped link's token bucket (tc tbf; a cloud VM's burst credit): the seconds of transfer
    # a message skips when its direction has rested at least that long (alpha and beta measured on
    # such rested messages). A message starting t < burst_s after the one before it on the same
    # direction ended finds the bucket partly empty and takes burst_s - t longer (lynx.planner.timeline)
    burst_s: _physical("burst_s") = 0.0  # type: ignore[valid-type]

    @model_serializer(mode="wrap")
    def _omit_unmeasured(self, handler: Any) -> Any:
        data = handler(self)   # a link without a host cost or a bucket records as before the fields existed
        for name in ("host_s_per_byte", "burst_s"):
            if isinstance(data, dict) and data.get(name) == 0.0:
                del data[name]
        return data


class Calibration(BaseModel):
    """How a measured spec was measured (``lynx calibrate``): where, when, how long, how steady.

    ``spread`` is, per measured field, ``(max − min) / median`` over the repeats; the spec
    holds the medians of the rates and the best repeat of the host costs (op overhead, optimizer
    steps, the runtime's work: other jobs' bursts only add to them) and of the links.
    ``cpu_share`` is, per field timed on one thread, the least share of a core its runs got
    (CPU time over wall time: 1.0 had a core to itself; the figure is CPU time, which other load
    inflates little, so this says how busy the machine was, not how wrong the figure is).
    ``unreliable`` names each field that may be off by more than :data:`RELIABLE_SPREAD` — a
    repeat that far from the median, or two best repeats that far apart — and why.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    host: str
    date: str  # ISO 8601, UTC
    method: int = CALIBRATION_METHOD  # what measured it (:data:`CALIBRATION_METHOD`; a file without it: 1)
    seconds: float = Field(ge=0.0)  # how long the calibration took
    repeats: int = Field(ge=1)
    threads: int = Field(ge=1)  # torch threads per process while measuring (a rank's)
    cpus: int = Field(ge=1)
    load_before: float = Field(ge=0.0)  # 1-minute load average
    load_after: float = Field(ge=0.0)
    torch: str
    spread: dict[str, float] = Field(default_factory=dict)
    cpu_share: dict[str, float] = Field(default_factory=dict)
    unreliable: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


class CoreShare(BaseModel):
    """``ranks`` processes on ``cores`` CPU cores (:func:`share_cores`): the spec's rates are each
    rank's static share, ``cores / ranks`` of a core, and the timeline replays the step with the
    cores shared among the ranks busy at each instant (:mod:`lynx.planner.core_sharing`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ranks: int = Field(ge=1)
    cores: int = Field(ge=1)


class HardwareSpec(BaseModel):
    """One device and its links; every rate is per device.

    ``source`` (the file it was read from) and ``calibration`` describe where a spec came
    from; neither is part of what a plan records or fingerprints.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    name: str
    device: Literal["cuda", "cpu"]
    peak_flops: dict[str, _physical("peak_flops")]  # type: ignore[valid-type]  # dtype name → dense FLOP/s
    achievable_fraction: float = Field(gt=0.0, le=1.0)
    memory_bandwidth: _physical("memory_bandwidth")  # type: ignore[valid-type]  # bytes/s
    memory_bytes: _physical("memory_bytes")  # type: ignore[valid-type]
    links: dict[str, LinkSpec]  # "pp", "tp", "dp"
    op_overhead_s: _physical("op_overhead_s") = 0.0  # type: ignore[valid-type]  # per op, not hidden by async launch
    # Host-bound costs a CPU run pays and a GPU hides (GPU presets: 0, not modelled):
    rng_s_per_element: _physical("rng_s_per_element") = 0.0  # type: ignore[valid-type]  # one random number
    # optimizer name -> step seconds per parameter
    optimizer_s_per_param: dict[str, _physical("optimizer_s_per_param")] = Field(  # type: ignore[valid-type]
        default_factory=dict)
    # Offload to host memory (lynx.planner.host_link): the device's link to the host and the
    # pinned host memory one device may fill; None: not described (offload is then refused)
    host_link: Optional[HostLinkSpec] = None
    host_memory_bytes: Optional[_physical("memory_bytes")] = None  # type: ignore[valid-type]
    # the runtime's own host work per action of a device's list (a forward or backward of one
    # microbatch, a send or receive it posts) beside the generated graphs: scheduling, p2p posting
    # and completion, loss, statistics
    runtime_action_s: _physical("runtime_action_s") = 0.0  # type: ignore[valid-type]
    # a CPU spec scaled for more ranks than cores (share_cores); None: a core or device per rank
    core_share: Optional[CoreShare] = None
    source: Optional[str] = Field(default=None, exclude=True)
    calibration: Optional[Calibration] = Field(default=None, exclude=True)

    @model_serializer(mode="wrap")
    def _omit_undescribed(self, handler: Any) -> Any:
        # a spec without a host link or a measured runtime cost records as it did before those
        # fields existed (same fingerprint)
        data = handler(self)
        if isinstance(data, dict):
            for key in ("host_link", "host_memory_bytes", "core_share"):
                if key in data and data[key] is None:
                    del data[key]
            if data.get("runtime_action_s") == 0.0:
                del data["runtime_action_s"]
        return data

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


def _gpu(name: str, fp16: float, fp32: float, bw: float, mem_gib: int, pp: LinkSpec, tp: LinkSpec,
         dp: LinkSpec, host: HostLinkSpec = PCIE4_X16, host_memory: int = HOST_MEMORY_PER_GPU["dgx-a100"]
         ) -> HardwareSpec:
    return HardwareSpec(
        name=name,
        device="cuda",
        peak_flops={"float16": fp16, "bfloat16": fp16, "float32": fp32},
        achievable_fraction=0.6,
        memory_bandwidth=bw,
        memory_bytes=mem_gib * _GiB,
        links={"pp": pp, "tp": tp, "dp": dp},
        host_link=host,
        host_memory_bytes=host_memory,
    )


# Links. Bandwidths are per device and per direction; α is the one-way latency of a message.
_NVLINK3 = LinkSpec(alpha_s=5e-6, beta_bytes_per_s=300e9)  # A100 NVLink3: 600 GB/s bidirectional
_NVLINK4 = LinkSpec(alpha_s=5e-6, beta_bytes_per_s=450e9)  # H100 NVLink4: 900 GB/s bidirectional
# InfiniBand HDR 200 Gb/s and NDR 400 Gb/s, one port per GPU: 25 and 50 GB/s.
_IB_HDR_PP, _IB_HDR_DP = LinkSpec(alpha_s=10e-6, beta_bytes_per_s=25e9), LinkSpec(alpha_s=20e-6, beta_bytes_per_s=25e9)
_IB_NDR_PP, _IB_NDR_DP = LinkSpec(alpha_s=10e-6, beta_bytes_per_s=50e9), LinkSpec(alpha_s=20e-6, beta_bytes_per_s=50e9)
# PCIe 4.0 x16 (PCI-SIG): 16 GT/s × 16 lanes × 128/130 = 31.5 GB/s per direction; about 80% of
# it is left after packet headers (TLP/DLLP overhead at 256-byte payloads), so 25 GB/s. α: a
# few µs per hop through the PCIe switch plus NCCL's launch, taken as 10 µs.
_PCIE4 = LinkSpec(alpha_s=10e-6, beta_bytes_per_s=25e9)


def _ethernet(gbit_per_s: float, alpha_s: float) -> LinkSpec:
    """Ethernet at its IEEE 802.3 line rate, less TCP/IPv4 framing at MTU 1500: 1448 payload
    bytes (20 IP + 32 TCP-with-timestamps header bytes) per 1538 on the wire (preamble, header,
    FCS, inter-frame gap) = 94.1% of the line rate."""
    return LinkSpec(alpha_s=alpha_s, beta_bytes_per_s=gbit_per_s * 1e9 / 8 * 1448 / 1538)


# A100 80GB: SXM 312 TF fp16/bf16 dense, 19.5 TF fp32 (non-TF32), 2.0 TB/s HBM2e; PCIe card:
# the same compute, 1.935 TB/s (NVIDIA A100 datasheet, 2021).
class _GpuFigures(TypedDict):
    """A GPU's datasheet figures, as :func:`_gpu` takes them."""

    fp16: float      # FLOP/s, dense
    fp32: float
    bw: float        # HBM bytes/s
    mem_gib: int


_A100_SXM = _GpuFigures(fp16=312e12, fp32=19.5e12, bw=2.0e12, mem_gib=80)
_A100_PCIE = _GpuFigures(fp16=312e12, fp32=19.5e12, bw=1.935e12, mem_gib=80)
# Ethernet between nodes over the kernel's TCP (NCCL's socket transport, no RDMA): a message
# costs tens of µs one way on one switch; 30 µs assumed. The presets give each GPU its own port
# (as cloud instances with a NIC per GPU do); a port shared by g GPUs gives each β/g — write
# your own file for that (docs/hardware.md).
_TCP_ALPHA = 30e-6

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # A100 SXM 80GB, NVLink3 inside a node, HDR InfiniBand between nodes.
    "a100-80g": _gpu("a100-80g", **_A100_SXM, pp=_IB_HDR_PP, tp=_NVLINK3, dp=_IB_HDR_DP),
    # H100 SXM: 989 TF fp16 dense, 67 TF fp32, 3.35 TB/s HBM3 (NVIDIA H100 datasheet), NVLink4,
    # NDR InfiniBand.
    "h100-sxm": _gpu("h100-sxm", 989e12, 67e12, 3.35e12, 80, pp=_IB_NDR_PP, tp=_NVLINK4, dp=_IB_NDR_DP,
                     host=PCIE5_X16, host_memory=HOST_MEMORY_PER_GPU["dgx-h100"]),
    # H200: H100's compute with 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
    "h200": _gpu("h200", 989e12, 67e12, 4.8e12, 141, pp=_IB_NDR_PP, tp=_NVLINK4, dp=_IB_NDR_DP,
                 host=PCIE5_X16, host_memory=HOST_MEMORY_PER_GPU["dgx-h100"]),
    # A box of A100 80GB PCIe cards without NVLink bridges: every link is PCIe 4.0 x16.
    "a100-pcie-box": _gpu("a100-pcie-box", **_A100_PCIE, pp=_PCIE4, tp=_PCIE4, dp=_PCIE4),
    # A100 SXM nodes joined by 25 GbE (2.94 GB/s of TCP payload) or 100 GbE (11.8 GB/s):
    # tensor parallelism inside a node on NVLink, pipeline and data parallelism across nodes.
    "a100-25gbe": _gpu("a100-25gbe", **_A100_SXM, pp=_ethernet(25, _TCP_ALPHA), tp=_NVLINK3,
                       dp=_ethernet(25, _TCP_ALPHA)),
    "a100-100gbe": _gpu("a100-100gbe", **_A100_SXM, pp=_ethernet(100, _TCP_ALPHA), tp=_NVLINK3,
                        dp=_ethernet(100, _TCP_ALPHA)),
    # Data parallelism between sites over 1 Gbit/s (117.7 MB/s) or 100 Mbit/s (11.8 MB/s) of
    # TCP — the setting DeMo and Distributed Lion are for — while each site's pipeline runs on
    # HDR InfiniBand and NVLink. α: one way across a metro link (1 Gbit/s, ~1 ms: light in fibre
    # covers 200 km per ms) and across a region (100 Mbit/s, ~10 ms); both assumed, not measured.
    "a100-dp-1gbit": _gpu("a100-dp-1gbit", **_A100_SXM, pp=_IB_HDR_PP, tp=_NVLINK3, dp=_ethernet(1, 1e-3)),
    "a100-dp-100mbit": _gpu("a100-dp-100mbit", **_A100_SXM, pp=_IB_HDR_PP, tp=_NVLINK3, dp=_ethernet(0.1, 10e-3)),
    # This machine's CPU cores, one thread per rank, gloo over loopback, as
    # `benchmarks/calibrate_cpu.py` measured them (the fastest of many runs on a loaded machine):
    # matmul and elementwise rates fitted to gpt-tiny's own nodes, the cost of an eager op, of a
    # random number and of an optimizer step per parameter, gloo's point-to-point link on a quiet
    # machine. `lynx calibrate` (`--hardware auto`) measures the machine at hand instead.
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
        optimizer_s_per_param={"adamw": 6.0e-9, "demo": 13e-9, "lion": 5.4e-9},
        # offload on a CPU: a memcpy into a separate buffer on the compute thread (64 MiB, one thread)
        host_link=HostLinkSpec(alpha_s=2e-6, d2h_bytes_per_s=8e9, h2d_bytes_per_s=8e9, shared_by=1, synchronous=True),
        host_memory_bytes=8 * _GiB,
    ),
}


def get_hardware(hardware: "str | HardwareSpec") -> HardwareSpec:
    """Return a preset by name, or ``hardware`` itself when it already is a spec (files and
    ``"auto"``: :func:`lynx.planner.hardware_ref.resolve_hardware`)."""
    if isinstance(hardware, HardwareSpec):
        return hardware
    try:
        return HARDWARE_PRESETS[hardware]
    except (KeyError, TypeError):
        raise LynxConfigError(
            f"unknown hardware {hardware!r}; presets: {', '.join(HARDWARE_PRESETS)} "
            "(or pass a lynx.HardwareSpec; for a hardware file or 'auto' use resolve_hardware)"
        ) from None


def share_cores(hw: HardwareSpec, ranks: int, cores: int) -> HardwareSpec:
    """``hw`` (a CPU spec, one core per rank) as each of ``ranks`` processes sees it on ``cores``.

    With more ranks than cores, each rank's costs are priced at ``cores / ranks`` of a core:
    compute rates scale down and host costs up by that share, and so does the tensor-parallel
    link, whose every collective is host work on a CPU (the pipeline's and data-parallel links
    are left as they are). That share is what a rank gets while every rank is busy; the spec
    records ``core_share``, and the timeline gives a busy rank more while other stages' ranks
    wait (:mod:`lynx.planner.core_sharing`: the cores shared among the busy ranks at each
    instant). A GPU spec, or no more ranks than cores, is returned unchanged.

    Example::

        >>> shared = share_cores(get_hardware("cpu-local"), ranks=4, cores=2)
        >>> shared.name, shared.op_overhead_s == 2 * get_hardware("cpu-local").op_overhead_s
        ('cpu-local-4on2', True)
        >>> shared.links["tp"].alpha_s == 2 * get_hardware("cpu-local").links["tp"].alpha_s, shared.links["pp"].alpha_s
        (True, 0.00015)
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
        "optimizer_s_per_param": {k: v / share for k, v in hw.optimizer_s_per_param.items()},
        "runtime_action_s": hw.runtime_action_s / share,
        "core_share": CoreShare(ranks=ranks, cores=cores),
        # a CPU's tp link is host work too (lynx.calibrate.allreduce, lynx.calibrate.tp_stage: gloo
        # copying through loopback, its threads waking, the collectives' dispatch); pp and dp keep theirs
        "links": {**hw.links, "tp": LinkSpec(alpha_s=hw.links["tp"].alpha_s / share,
                                             beta_bytes_per_s=hw.links["tp"].beta_bytes_per_s * share)},
    })
