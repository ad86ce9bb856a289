"""What a GPU costs: dense matmul FLOP/s per dtype, memory (HBM) bandwidth, kernel launch overhead.

Each is timed with CUDA events over a few back-to-back runs after a warm-up: square matmuls
large enough to saturate the device (``2·n³`` FLOPs each), a device-to-device copy of 1 GiB
(read plus write: twice its bytes), and a stream of tiny kernels (what an op costs when the
host, not the device, is the limit). float32 is timed as torch runs it now
(``torch.backends.cuda.matmul.allow_tf32`` decides whether that is TF32).

Example (on a machine with CUDA)::

    >>> import torch
    >>> from lynx.calibrate.gpu import matmul_flops
    >>> rates = matmul_flops(torch.device("cuda"), n=1024, runs=2) if torch.cuda.is_available() else {"float32": 1.0}
    >>> all(r > 0 for r in rates.values())
    True
"""

from __future__ import annotations

import functools

import torch

__all__ = ["matmul_flops", "memory_bandwidth", "launch_overhead_s", "device_memory_bytes"]

_SIZES = {"float32": 4096, "bfloat16": 8192, "float16": 8192}


def _timed(fn, runs: int) -> float:
    """Seconds per call of ``fn`` on the current stream, after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / runs


def matmul_flops(device: torch.device, n: int | None = None, runs: int = 10) -> dict[str, float]:
    """Dense matmul FLOP/s per dtype name (float32, bfloat16, float16)."""
    out = {}
    for name, size in _SIZES.items():
        size = n or size
        dtype = getattr(torch, name)
        a = torch.randn(size, size, device=device, dtype=dtype)  # (n, n)
        b = torch.randn(size, size, device=device, dtype=dtype)  # (n, n)
        out[name] = 2 * size**3 / _timed(functools.partial(torch.mm, a, b), runs)
        del a, b
    return out


def memory_bandwidth(device: torch.device, gib: float = 1.0, runs: int = 10) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    numel = int(gib * 2**30) // 4
    src = torch.empty(numel, device=device)  # (numel,) fp32
    dst = torch.empty_like(src)
    rate = 2 * src.numel() * src.element_size() / _timed(functools.partial(dst.copy_, src), runs)
    del src, dst
    return rate


def launch_overhead_s(device: torch.device, ops: int = 2000) -> float:
    """Seconds per tiny kernel when launched back to back (the host's cost of an op)."""
    x = torch.zeros(4, device=device)
    return _timed(lambda: [x.add_(1.0) for _ in range(ops)], 3) / ops


def device_memory_bytes(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory)
