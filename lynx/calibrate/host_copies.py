"""What a copy to host memory and back costs: the host link ``lynx calibrate`` measures.

* **CUDA**: pinned host buffers and a side stream, as offloading copies use them: a 256 MiB
  copy each way (device → host, host → device) timed with CUDA events, bandwidth = bytes /
  time; a 4 KiB copy gives the latency per copy.
* **CPU**: offloading on a CPU copies into a separate host buffer on the compute thread (the
  link is *synchronous*): a 64 MiB ``copy_`` between two buffers, and a 4 KiB one for the
  latency. Both directions are the same memcpy.

Beside them, the names a calibration gives the host link's figures (:data:`HOST_LINK_FIGURES`)
and the host's RAM (:func:`physical_memory`), which bounds the host memory offload may use.

Example::

    >>> rates = memcpy_link(nbytes=1 << 20, runs=2)
    >>> rates["alpha_s"] >= 0 and rates["d2h_bytes_per_s"] > 1e6
    True
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["memcpy_link", "memcpy_links", "pinned_link", "HOST_LINK_FIGURES", "physical_memory"]

_SMALL = 4096

# the host link's figures, as a calibration names them (each the median of its repeats)
HOST_LINK_FIGURES = ("host_link.alpha_s", "host_link.d2h_bytes_per_s", "host_link.h2d_bytes_per_s")


def physical_memory() -> int:
    """This host's RAM in bytes (8 GiB where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _best(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_link(nbytes: int = 64 << 20, runs: int = 5) -> dict[str, float]:
    """The CPU's host link: one thread copying between two buffers (alpha, bytes/s each way)."""
    return memcpy_links(1, nbytes, runs)[0]


def memcpy_links(repeats: int, nbytes: int = 64 << 20, runs: int = 5) -> list[dict[str, float]]:
    """:func:`memcpy_link` ``repeats`` times on one pair of buffers: making and first touching
    two fresh 64 MiB buffers took longer than the copies timed in them (~0.1 s a repeat)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    small_src, small_dst = src[:_SMALL], dst[:_SMALL]
    out = []
    for _ in range(repeats):
        rate = nbytes / _best(lambda: dst.copy_(src), runs)
        alpha = max(0.0, _best(lambda: small_dst.copy_(small_src), runs * 20) - _SMALL / rate)
        out.append({"alpha_s": alpha, "d2h_bytes_per_s": rate, "h2d_bytes_per_s": rate})
    return out


def pinned_link(device: torch.device, nbytes: int = 256 << 20, runs: int = 5) -> dict[str, float]:
    """A GPU's host link: pinned host memory ↔ device on a side stream, timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def timed(copy) -> float:
        with torch.cuda.stream(stream):
            copy()   # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = float("inf")
            for _ in range(runs):
                start.record(stream)
                copy()
                end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
        return best

    d2h = nbytes / timed(lambda: host.copy_(dev, non_blocking=True))
    h2d = nbytes / timed(lambda: dev.copy_(host, non_blocking=True))
    small_host, small_dev = host[:_SMALL], dev[:_SMALL]
    alpha = max(0.0, timed(lambda: small_dev.copy_(small_host, non_blocking=True)) - _SMALL / h2d)
    return {"alpha_s": alpha, "d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d}
