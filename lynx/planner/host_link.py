"""The host link: what offloading an activation to host memory costs, per direction.

A device copies a saved value to pinned host memory after its forward (device → host, D2H)
and back before its backward (host → device, H2D) on its copy engines, which run beside
compute. :class:`HostLinkSpec` gives one copy's latency and each direction's bandwidth per
device, and how many devices of a node share one link (``shared_by``: on a DGX A100 two GPUs
sit behind each PCIe switch's single x16 uplink to the CPU). ``HardwareSpec.host_link`` and
``HardwareSpec.host_memory_bytes`` (the pinned host memory one device may fill) hold them.

Figures, with their sources:

* **PCIe 4.0 x16** (PCI-SIG, PCIe Base Specification 4.0): 16 GT/s per lane, 128b/130b
  encoding: 31.5 GB/s per direction. Pinned ``cudaMemcpyAsync`` reaches about 80% of it
  after TLP/DLLP overhead at 256-byte payloads (NVIDIA's ``bandwidthTest`` reads 24–26 GB/s on
  A100 servers): **25 GB/s**. One copy costs ~10 µs of launch and DMA set-up.
* **PCIe 5.0 x16** (PCIe Base Specification 5.0): 32 GT/s per lane, 63 GB/s per direction;
  80% of it, **50 GB/s** (H100 servers' ``nvbandwidth`` host-to-device figures are 50–55 GB/s).
* **Host memory per device**: NVIDIA DGX A100 datasheet, 1 TB of system memory for 8 GPUs;
  DGX H100 and DGX H200 datasheets, 2 TB for 8 GPUs. Half of each device's share is taken as
  pinnable for activations (the rest holds the data loader, the OS page cache, checkpoints).
* **A CPU device**: "offloading" copies into a separate host buffer on the same cores; the
  copy takes the compute thread's time (:attr:`HostLinkSpec.synchronous`). ``lynx calibrate``
  measures it (a memcpy of 64 MiB); ``cpu-local`` holds this machine's figure.

Example::

    >>> from lynx.planner.host_link import PCIE4_X16, copy_seconds
    >>> round(copy_seconds(PCIE4_X16, 256 * 2**20, "d2h") * 1e3, 2)   # 256 MiB to the host
    10.75
    >>> PCIE4_X16.model_copy(update={"shared_by": 2}).per_device("h2d") / 1e9
    12.5
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lynx.errors import LynxConfigError

__all__ = ["HostLinkSpec", "PCIE4_X16", "PCIE5_X16", "HOST_MEMORY_PER_GPU", "copy_seconds", "host_link_of"]

Direction = Literal["d2h", "h2d"]


class HostLinkSpec(BaseModel):
    """One device's link to host memory: latency of a copy and bandwidth per direction.

    ``shared_by`` devices of a node share the link (both directions): each gets its share
    when they copy at once, and the timeline serialises their copies on one lane per
    direction. ``synchronous``: copies run on the compute thread (a CPU device), not on copy
    engines beside it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    alpha_s: float = Field(ge=0.0, le=1.0)
    d2h_bytes_per_s: float = Field(ge=1e6, le=1e13)
    h2d_bytes_per_s: float = Field(ge=1e6, le=1e13)
    shared_by: int = Field(1, ge=1, le=64)
    synchronous: bool = False

    def per_device(self, direction: Direction) -> float:
        """Bytes/s one device can count on in ``direction`` when all sharers copy at once."""
        rate = self.d2h_bytes_per_s if direction == "d2h" else self.h2d_bytes_per_s
        return rate / self.shared_by


PCIE4_X16 = HostLinkSpec(alpha_s=10e-6, d2h_bytes_per_s=25e9, h2d_bytes_per_s=25e9, shared_by=1, synchronous=False)
PCIE5_X16 = HostLinkSpec(alpha_s=10e-6, d2h_bytes_per_s=50e9, h2d_bytes_per_s=50e9, shared_by=1, synchronous=False)
# half of each GPU's share of a DGX's system memory (see the module docstring)
HOST_MEMORY_PER_GPU = {"dgx-a100": 64 * 2**30, "dgx-h100": 128 * 2**30}


def copy_seconds(link: HostLinkSpec, nbytes: int, direction: Direction) -> float:
    """Seconds one copy of ``nbytes`` takes on ``link`` (its own lane, nobody else copying)."""
    if nbytes <= 0:
        return 0.0
    rate = link.d2h_bytes_per_s if direction == "d2h" else link.h2d_bytes_per_s
    return link.alpha_s + nbytes / rate


def host_link_of(hardware: object) -> HostLinkSpec:
    """``hardware``'s host link, or a clear error saying how to give one."""
    link = getattr(hardware, "host_link", None)
    if link is None:
        name = getattr(hardware, "name", hardware)
        raise LynxConfigError(
            f"offload needs the host link of hardware {name!r} (bandwidth per direction, latency): it has none. "
            "Use a preset that has one (a100-80g: PCIe 4.0; h100-sxm, h200: PCIe 5.0), add "
            "`host_link: {alpha_s: 10e-6, d2h_bytes_per_s: 25e9, h2d_bytes_per_s: 25e9}` to your hardware file "
            "(docs/hardware.md), or measure it with `lynx calibrate`")
    return link
