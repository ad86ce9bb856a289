"""The tensor-parallel link as a TP stage uses it: all-reduces of a ladder of sizes, fitted α + n/β.

A TP stage's generated code issues ``_c10d_functional.all_reduce`` and later waits for it with
``_c10d_functional.wait_tensor`` (:mod:`lynx.frontend.joint_tp`); the time between the two, on
a rank's main thread, is what the timeline prices as a ``tp_allreduce``. Two processes on a
gloo group (:func:`measure_allreduce` forks them, on a ``FileStore`` of their own; ``lynx
calibrate`` uses the two ranks that time a TP stage, :mod:`lynx.calibrate.tp_stage`, once they
have: :func:`ladder_trips`) run exactly those two ops back to back, a
ladder of sizes (:data:`LADDER_BYTES`, spanning a small model's activations to a large one's),
and per repeat keep each size's fastest trip: a trip needs both processes on a core at once,
other load only ever delays it, so the fastest trip is the collective's own cost — the
functional collective's dispatch, gloo's work and its threads' hand-offs, the wait — where a
point-to-point 1-element round trip (:mod:`lynx.calibrate.links`, the pipeline's link) leaves
most of it out (33 µs of α against 0.19 ms for a 32 KiB all-reduce on the development machine).

:func:`fit_allreduce` fits ``t(n) = a + b·n`` to the sizes' medians over the repeats (least
squares on the relative error, so the small sizes, where α is seen, weigh as much as the large
ones) and returns the :class:`~lynx.planner.hardware.LinkSpec` whose ring all-reduce
(:func:`lynx.planner.cost.allreduce_time`) over ``world`` ranks takes that time.

Example::

    >>> from lynx.calibrate.allreduce import fit_allreduce
    >>> from lynx.planner.cost import allreduce_time
    >>> sizes = [4096, 32768, 262144]
    >>> link = fit_allreduce(sizes, [100e-6 + n / 2e9 for n in sizes])
    >>> round(link.alpha_s * 1e6, 3), round(link.beta_bytes_per_s / 1e9, 3)
    (50.0, 2.0)
    >>> round(allreduce_time(32768, 2, link) * 1e6, 1)
    116.4
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lynx.calibrate.forked import collect, staged_rank, why_not
from lynx.errors import LynxRuntimeError
from lynx.planner.hardware import PHYSICAL_RANGES, LinkSpec

__all__ = ["LADDER_BYTES", "measure_allreduce", "ladder_trips", "fit_allreduce", "allreduce_link"]

# 4 KiB to 2 MiB: gpt-tiny's activations (32-128 KiB) in the middle, a few large ones for β
LADDER_BYTES = (4096, 32768, 262144, 2097152)


def measure_allreduce(repeats: int = 5, trips: int = 40, sizes: Sequence[int] = LADDER_BYTES,
                      timeout_s: float = 60.0) -> list[list[float]]:
    """Per repeat, per size of ``sizes`` (bytes), the fastest of ``trips`` functional all-reduces
    (issue and wait) between two processes of this host, in seconds. Needs ``fork``."""
    if not hasattr(os, "fork"):
        raise LynxRuntimeError("measuring the tensor-parallel all-reduce forks two processes; this platform has no "
                               "fork")
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="lynx-allreduce-") as folder:
        queue = ctx.Queue()
        args = (os.path.join(folder, "store"), repeats, trips, tuple(sizes), timeout_s)
        procs = [ctx.Process(target=staged_rank, args=(_worker, rank, None, queue, *args), daemon=True)
                 for rank in range(2)]
        items, missing = collect(procs, queue, 2, timeout_s)
    results: dict[int, Any] = dict(items)
    if not isinstance(results.get(0), list):   # rank 0's times per repeat and size, or why not
        raise LynxRuntimeError(f"could not measure gloo all-reduces between two processes: "
                               f"{why_not(results, missing) or 'rank 0 sent no result'}")
    return results[0]


def fit_allreduce(sizes: Sequence[int], seconds: Sequence[float], world: int = 2) -> LinkSpec:
    """The link whose ring all-reduce over ``world`` ranks fits ``seconds`` at ``sizes`` (bytes):
    ``t = a + b·n`` by least squares on the relative error, then ``a = 2(W−1)·α`` and
    ``b = 2(W−1)/W / β`` (:func:`lynx.planner.cost.allreduce_time`). A negative intercept
    (noise at the small sizes) fits through the origin; a slope ≤ 0 takes the fastest β
    physically allowed."""
    if len(sizes) != len(seconds) or len(sizes) < 2 or world < 2:
        raise LynxRuntimeError(f"fitting an all-reduce needs 2 or more (size, seconds) pairs and world >= 2, got "
                               f"{len(sizes)} sizes, {len(seconds)} times, world {world}")
    weights = [1.0 / t ** 2 for t in seconds]   # relative error: each size counts alike
    sw = sum(weights)
    sn = sum(w * n for w, n in zip(weights, sizes))
    snn = sum(w * n * n for w, n in zip(weights, sizes))
    st = sum(w * t for w, t in zip(weights, seconds))
    snt = sum(w * n * t for w, n, t in zip(weights, sizes, seconds))
    det = sw * snn - sn * sn
    a, b = ((snn * st - sn * snt) / det, (sw * snt - sn * st) / det) if det > 0 else (-1.0, 0.0)
    if a < 0:
        a, b = 0.0, snt / snn
    low_alpha, high_alpha, _ = PHYSICAL_RANGES["alpha_s"]
    low_beta, high_beta, _ = PHYSICAL_RANGES["beta_bytes_per_s"]
    steps = 2 * (world - 1)
    beta = steps / world / b if b > 0 else high_beta
    return LinkSpec(alpha_s=min(max(a / steps, low_alpha), high_alpha), beta_bytes_per_s=min(max(beta, low_beta),
                                                                                           high_beta))


def allreduce_link(per_repeat: list[list[float]],
                   sizes: Sequence[int] = LADDER_BYTES) -> tuple[LinkSpec, list[LinkSpec]]:
    """The link fitted to each size's median over the repeats, and one fitted to each repeat
    (their spread says how steady the measurement was)."""
    medians = [statistics.median(r[i] for r in per_repeat) for i in range(len(sizes))]
    return fit_allreduce(sizes, medians), [fit_allreduce(sizes, r) for r in per_repeat]


def _worker(rank: int, gate: None, store_path: str, repeats: int, trips: int, sizes: tuple[int, ...],
            timeout_s: float) -> list[list[float]] | None:
    """One of the two ranks (:func:`lynx.calibrate.forked.staged_rank` runs it): rank 0 returns
    the times, rank 1 None."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.group.WORLD
    assert world is not None  # just initialised
    out = ladder_trips(world.group_name, repeats, trips, sizes)
    return out if rank == 0 else None


def ladder_trips(group_name: str, repeats: int = 5, trips: int = 40,
                 sizes: Sequence[int] = LADDER_BYTES) -> list[list[float]]:
    """Per repeat, per size of ``sizes`` (bytes), the fastest of ``trips`` functional all-reduces
    on the gloo group named ``group_name`` (every rank of it calls this). The tensor-parallel
    ranks of :mod:`lynx.calibrate.tp_stage` call it on their own group once the stage is timed."""
    buffers = [torch.ones(max(1, n // 4)) for n in sizes]
    for buf in buffers:  # warm-up: connections, gloo's buffers, the ops' dispatch
        for _ in range(3):
            _trip(buf, group_name)
    return [[min(_trip(buf, group_name) for _ in range(trips)) for buf in buffers] for _ in range(repeats)]


def _trip(buf: torch.Tensor, group_name: str) -> float:
    """Seconds of one all-reduce as a TP stage's generated code runs it: issue, then wait."""
    start = time.perf_counter()
    out = torch.ops._c10d_functional.all_reduce(buf, "sum", group_name)
    torch.ops._c10d_functional.wait_tensor(out)
    return time.perf_counter() - start
