"""A tensor-parallel CPU rank on a core of its own, where the job's ranks fill the host's cores evenly.

On a 2-core host a pp 1 × tp 2 job's two ranks, each a main thread and gloo's loop and work
threads, were left to the scheduler: each of the step's 64 all-reduces hands work between six
threads, and whether the two ranks' threads sat on one core or on both changed from second to
second. Steps then ran at two speeds and a run's median moved with the mix: 30-step medians
of the same plan read 108, 131 and 157 ms on one machine within minutes, and the ``lynx
calibrate`` reference TP stage, which prices each collective's hand-offs, spread 36% between
repeats. Pinned, each rank's threads on the core of its TP rank, the same runs read 107-125 ms,
and faster (benchmarks/results/tp_pinning_2026-12-05.txt).

:func:`pin_plan` decides: a rank of a tensor-parallel job (tp ≥ 2: the hand-offs are its
collectives') pins only where every core gets the same share of every group of ranks that can
be busy at once — the job's ranks on this host are as many as its cores, or a multiple of them
with tp a multiple too (tp is the mesh's innermost dimension, so the ranks of a TP group, busy
together, land on distinct cores and each stage's group loads every core alike: the even share
:mod:`lynx.planner.core_sharing` prices). Anything else (no TP, more ranks than cores with
stages that idle apart, fewer ranks than cores) is left to the scheduler, which balances such
loads, and other jobs' beside them, better than a fixed map.
:func:`pin_rank` applies it to every thread of this process (gloo's exist by the time a
:class:`lynx.runtime.Pipeline` is built; threads started later inherit the calling one's).

Example::

    >>> pin_plan(local_rank=1, ranks_here=4, tp=2, cores=[0, 1])
    1
    >>> pin_plan(local_rank=2, ranks_here=4, tp=1, cores=[0, 1]) is None   # stages idle apart
    True
    >>> pin_plan(local_rank=0, ranks_here=2, tp=2, cores=[0, 1, 2, 3]) is None   # room to spare
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["pin_plan", "pin_rank"]


def pin_plan(local_rank: int, ranks_here: int, tp: int, cores: Sequence[int]) -> int | None:
    """The core (one of ``cores``, the CPUs this process may use) that local rank
    ``local_rank`` of ``ranks_here`` ranks on this host should run on, or None where the
    job has no TP or its ranks do not fill the cores evenly (see the module docstring)."""
    n = len(cores)
    if tp < 2 or n < 2 or ranks_here < n or ranks_here % n:
        return None
    if ranks_here != n and tp % n:
        return None
    return sorted(cores)[local_rank % n]


def pin_rank(tp: int = 1) -> int | None:
    """Pin every thread of this process to :func:`pin_plan`'s core for this rank (from
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, as torchrun sets them, else ``RANK`` and
    ``WORLD_SIZE``); the core, or None where it leaves the process to the scheduler (and
    where the platform has no affinity control)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    env = os.environ
    try:
        rank = int(env.get("LOCAL_RANK", env.get("RANK", "0")))
        here = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    except ValueError:
        return None
    core = pin_plan(rank, here, tp, sorted(os.sched_getaffinity(0)))
    if core is None:
        return None
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, {core})
        except OSError:   # the thread ended meanwhile
            pass
    return core
