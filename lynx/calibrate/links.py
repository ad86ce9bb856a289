"""A link's α (latency) and β (bandwidth) between two processes: gloo on CPU, NCCL between two GPUs.

Two worker processes join a process group of their own (a ``FileStore`` in a temporary folder,
no default group, so this also runs inside a rank of a training job) and time point-to-point
round trips one by one: α is half the fastest of many 1-element round trips, β what a 1 MiB
message takes one way beyond α in the fastest of several. A round trip needs both processes on a
core; other load only ever delays one, so the fastest trip is the link's own time and a repeat
is steady where a mean over trips follows the load. On CPU the workers are forked (no second
torch import), each pinned to a core of its own where there are two
(:func:`lynx.calibrate.forked.pin_to_core`), as a training job's two busy ranks run: left to the
scheduler they sometimes shared a core, and β read 4.7 GB/s in one calibration and 7.8 in the
next; pinned, five repeats' fastest trips agree within 5% and the fastest of 50 large (200
small) trips is the fastest of 100 (400). For NCCL they are spawned, one per GPU.

``lynx calibrate`` on a CPU forks no pair for it: the two pipeline ranks that measure the
runtime (:mod:`lynx.calibrate.runtime`, a core each) run :func:`link_trips` on a gloo group of
their own once their steps are timed, which saves the fork, the group and the teardown of a
pair of their own (~1 s of a 2-core calibration's critical path) and times the same trips.

Example::

    >>> from lynx.calibrate.links import measure_link
    >>> alphas, betas = measure_link("gloo", repeats=1, small_trips=5, large_trips=1, large_numel=2**16)
    >>> 0 < alphas[0] < 1.0 and betas[0] > 0
    True
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from lynx.calibrate.forked import collect, pin_to_core, staged_rank, why_not
from lynx.errors import LynxRuntimeError

__all__ = ["measure_link", "link_trips", "CALIBRATION_SMALL_TRIPS"]

# 1-element round trips per repeat in ``lynx calibrate`` (its repeats are twice as many, so
# that β's best repeat more often sees the two vCPUs sharing a cache:
# lynx.calibrate.host.LINK_REPEATS_PER_REPEAT); α, the fastest of all of them, sees 1000 trips
CALIBRATION_SMALL_TRIPS = 100


def measure_link(backend: str, repeats: int = 5, small_trips: int = 200, large_trips: int = 50,
                 large_numel: int = 2**18, timeout_s: float = 60.0) -> tuple[list[float], list[float]]:
    """Per repeat, ``(alpha_s, beta_bytes_per_s)`` of one link between two processes."""
    ctx = mp.get_context("fork" if backend == "gloo" and hasattr(os, "fork") else "spawn")
    with tempfile.TemporaryDirectory(prefix="lynx-link-") as folder:
        queue = ctx.Queue()
        args = (backend, os.path.join(folder, "store"), repeats, small_trips, large_trips, large_numel, timeout_s)
        procs = [ctx.Process(target=staged_rank, args=(_worker, rank, None, queue, *args), daemon=True)
                 for rank in range(2)]
        items, missing = collect(procs, queue, 2, timeout_s)
    results: dict[int, Any] = dict(items)
    if not isinstance(results.get(0), tuple):   # rank 0's (alphas, betas), or why not
        raise LynxRuntimeError(f"could not measure the {backend} link between two processes: "
                               f"{why_not(results, missing) or 'rank 0 sent no result'}")
    return results[0]


def _worker(rank: int, gate: None, backend: str, store_path: str, repeats: int, small_trips: int,
            large_trips: int, large_numel: int, timeout_s: float) -> tuple[list[float], list[float]] | None:
    """One of the two ranks (:func:`lynx.calibrate.forked.staged_rank` runs it): rank 0 returns
    the figures, rank 1 None."""
    if backend == "gloo":
        pin_to_core(rank)   # a core each, before gloo's threads start (lynx.calibrate.forked)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.FileStore(store_path, 2)
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    else:
        device = torch.device("cpu")
        group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    alphas, betas = link_trips(group, rank, repeats, small_trips, large_trips, large_numel, device)
    return (alphas, betas) if rank == 0 else None


def link_trips(group: Any, rank: int, repeats: int = 5, small_trips: int = 200, large_trips: int = 50,
               large_numel: int = 2**18, device: torch.device | None = None) -> tuple[list[float], list[float]]:
    """Per repeat, ``(alpha_s, beta_bytes_per_s)`` timed on ``group`` (a process group of two,
    ``rank`` being 0 or 1; both ranks call it): α half the fastest of ``small_trips`` 1-element
    round trips, β a ``large_numel``-float message's fastest one way beyond α. The pipeline
    ranks of :mod:`lynx.calibrate.runtime` call it on their own group once their steps are done."""
    device = device or torch.device("cpu")
    small, large = torch.zeros(1, device=device), torch.zeros(large_numel, device=device)
    peer = 1 - rank
    alphas, betas = [], []
    _trips(group, small, peer, rank, 2, device)  # warm-up: connections, buffers
    _trips(group, large, peer, rank, 1, device)
    for _ in range(repeats):
        alpha = _fastest_trip(group, small, peer, rank, small_trips, device) / 2
        one_way = _fastest_trip(group, large, peer, rank, large_trips, device) / 2
        alphas.append(alpha)
        betas.append(large.numel() * large.element_size() / max(one_way - alpha, 1e-9))
    return alphas, betas


def _fastest_trip(group, buf: torch.Tensor, peer: int, rank: int, trips: int, device: torch.device) -> float:
    """Seconds of the fastest of ``trips`` round trips of ``buf`` (rank 0 sends first)."""
    best = float("inf")
    for _ in range(trips):
        best = min(best, _trips(group, buf, peer, rank, 1, device))
    return best


def _trips(group, buf: torch.Tensor, peer: int, rank: int, trips: int, device: torch.device) -> float:
    """Seconds for ``trips`` round trips of ``buf`` (rank 0 sends first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(trips):
        if rank == 0:
            group.send([buf], peer, 0).wait()
            group.recv([buf], peer, 0).wait()
        else:
            group.recv([buf], peer, 0).wait()
            group.send([buf], peer, 0).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - start
