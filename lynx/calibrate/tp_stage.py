"""What a tensor-parallel collective costs inside a TP stage, beyond the all-reduce alone.

The all-reduce ladder (:mod:`lynx.calibrate.allreduce`) times collectives back to back, with
gloo's threads awake. Inside a TP stage's generated code each all-reduce comes between ops:
its issue and wait wake threads that slept through the compute before it, the two ranks meet
only as fast as the later one arrives, and the sharded graph runs ops the unsharded profile
does not count (the DTensor conversions around each sharded linear: views, a bias added after
the reduction). On the development machine (a 2-vCPU VM) gpt-tiny at seq 32 × 4 and tp 2 ran
its generated graphs in 27 ms of CPU time but 100 ms of wall time, 64 all-reduces that cost
0.18 ms each back to back costing ~1.2 ms each there.

:func:`tp_stage_s` measures that on the thing itself: a small reference (gpt-tiny at seq 4 × 1,
4 microbatches, compiled for pp 1 × tp 2, :class:`~lynx.calibrate.cpu.ReferenceModel`) runs
through :class:`lynx.runtime.Pipeline`'s stage on two forked processes (gloo on 127.0.0.1, a
port of their own), its 4 microbatches' forwards then backwards, and each repeat keeps the
median of its runs' wall seconds. Not the fastest, as for a figure timed on one thread: a run's
64 collectives each wake gloo's threads on both ranks (a rank's main thread, gloo's loop and
work threads: six threads on a 2-vCPU VM) and how those hand-offs meet the two ranks' compute
differs run to run with nothing else running — with no other load at all, a pp 1 × tp 2 training's
median step was 1.2× its fastest (benchmarks/results/tp_prediction_quiet_2026-12-05c.json), and the
stage's runs here spread as much (fastest of 7 81.7 ms, median 100.4 ms). Every step pays that
typical cost, so the fastest run priced the collectives at a lucky run's. The ranks' threads stay on
a core each, as :class:`lynx.runtime.Pipeline` keeps a TP training job's that fills the cores
(:mod:`lynx.runtime.core_pin`): left to the scheduler, where they sat moved from second to
second and the repeats' per-collective figure with it (quiet calibrations read 532-814 µs for the
tp link's α; pinned, under other sessions' load, 437-548 µs in six calibrations' TP stages).
:func:`per_collective_s` takes what the cost model prices that run at — the arithmetic and
per-op cost of the rank's nodes (:func:`lynx.planner.tp_costs.rank_seconds`) and every
all-reduce on the fitted link — from it, and divides what is left by the collectives the run
issued: the per-collective term the tp link's α carries (:mod:`lynx.calibrate.host`).

What that costs moves with the moment, not with the processes: the stage idles between its
hand-offs (its ranks used ~55 ms of CPU per 80 ms run) and whatever else the host runs then
delays them. In one pair of ranks, four blocks of 27 runs 5 s apart read medians of 60-71, 62-89
and 78-97 ms, as far apart as separate calibrations; under other sessions' nice-19 jobs each
10 ms of CPU they took during a run lengthened it by ~4.5 ms, and ten calibrations a minute
apart read 447-704 µs as those jobs' share rose. So ``lynx calibrate`` times the runs in blocks
spread over its repeats (:data:`TP_STAGE_RUNS`, ``blocks``), the figure the median over them and
their spread how much the moment moved it, and reports the cpus other processes took meanwhile
(:func:`others_cpus`), with which the figure is not the host's alone.

Example (forks two processes; a few seconds)::

    >>> from lynx.calibrate.cpu import ReferenceModel
    >>> from lynx.calibrate.tp_stage import tp_stage_s
    >>> sharded = ReferenceModel(seq=4, microbatch=1, tp=2)               # doctest: +SKIP
    >>> walls = tp_stage_s(sharded, repeats=1, runs=2)                     # doctest: +SKIP
    >>> 0 < walls[0] < 1.0                                                 # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, NamedTuple

import torch

from lynx.calibrate.cpu import ReferenceModel
from lynx.errors import LynxRuntimeError

__all__ = ["tp_stage_s", "start_tp_stage_s", "tp_stage_results", "TPMeasured", "priced_stage_s", "per_collective_s",
           "others_cpus", "TP_STAGE_RUNS", "block_runs"]

# runs of the stage in a calibration, all blocks together: a run takes ~0.08 s on 2 cores, so
# ~2 s in all (with a warm-up run per block, 30 runs against method 9's 3 × 9 and one warm-up,
# 28). ``lynx calibrate`` times them in one block after each of its repeats (Staged.run_block),
# not back to back: what a collective costs here moved with the moment
# (the other load in the stage's idle gaps, the host), and 27 runs in one stretch of ~2.3 s read
# 80, 92 and 120 ms median in three quiet calibrations minutes apart, each stretch's 3 repeats
# within 4%. Blocks spread over the calibration's repeats see more of those moments, and their
# spread says how much the figure moved while it was measured.
TP_STAGE_RUNS = 25


def block_runs(blocks: int) -> int:
    """Runs per block when the calibration's :data:`TP_STAGE_RUNS` are timed in ``blocks``
    blocks (at least 3, so a block's median is a run's, not an outlier's).

        >>> block_runs(5), block_runs(1), block_runs(20)
        (5, 25, 3)
    """
    return max(3, -(-TP_STAGE_RUNS // max(1, blocks)))


class TPMeasured(NamedTuple):
    """What :func:`start_tp_stage_s`'s ranks measured: per repeat (block), rank 0's median run's
    seconds; the all-reduce ladder per repeat and size
    (:func:`lynx.calibrate.allreduce.ladder_trips`), or None when not asked for; and per repeat
    the cpus other processes took while it ran (:func:`others_cpus`; None where ``/proc/stat``
    is not there to say)."""

    walls: list[float]
    ladder: list[list[float]] | None
    others: list[float] | None = None


def tp_stage_s(reference: ReferenceModel, repeats: int = 5, runs: int = 5, timeout_s: float = 120.0) -> list[float]:
    """Per repeat, the median of ``runs`` wall seconds of the TP reference's generated forwards
    and backwards (all its microbatches) on rank 0 of two forked processes. Needs ``fork``."""
    with start_tp_stage_s(reference, repeats, runs, timeout_s) as started:
        return tp_stage_results(reference, started).walls


def start_tp_stage_s(reference: ReferenceModel, repeats: int = 5, runs: int = 5, timeout_s: float = 120.0,
                     ladder_repeats: int = 0, blocks: bool = False) -> Any:
    """Fork the two ranks: they build the TP stage and trace it (the first run, ~3 s of CPU
    each), then wait for :func:`tp_stage_results` to let them time it
    (:class:`lynx.calibrate.forked.Staged`) — or, with ``blocks``, time each repeat when
    :meth:`~lynx.calibrate.forked.Staged.run_block` lets it (every repeat must be let go before
    :func:`tp_stage_results`); with ``ladder_repeats``, they time the all-reduce ladder on their
    group after the stage (:mod:`lynx.calibrate.allreduce`), without forking and joining a group
    for it."""
    if not hasattr(os, "fork"):
        raise LynxRuntimeError("measuring a tensor-parallel stage forks two ranks of this process; this platform "
                               "has no fork")
    from lynx.calibrate.forked import Staged
    from lynx.runtime.topology import free_port

    tp = reference.compiled.config.tp
    return Staged(_worker, tp, (tp, free_port(), reference.compiled, repeats, runs, timeout_s, ladder_repeats,
                                blocks), timeout_s)


def tp_stage_results(reference: ReferenceModel, started: Any) -> TPMeasured:
    """What rank 0 of :func:`start_tp_stage_s` measured (:class:`TPMeasured`)."""
    from lynx.calibrate.forked import why_not

    items, missing = started.results()
    results: dict[int, Any] = dict(items)
    errors = why_not(results, missing)
    if errors or 0 not in results:
        raise LynxRuntimeError(f"could not run a tensor-parallel stage on {reference.compiled.config.tp} processes "
                               f"to time its collectives: {errors or 'rank 0 sent no result'}")
    walls, ladder, host_busy = results[0][:3]
    own = [sum(parts) for parts in zip(*(results[r][3] for r in sorted(results)))]
    spans = results[0][4]
    others = None if host_busy is None else [others_cpus(b, o, t) for b, o, t in zip(host_busy, own, spans)]
    return TPMeasured(walls, ladder, others)


def others_cpus(host_busy_s: float, own_cpu_s: float, span_s: float) -> float:
    """The cpus other processes took while the stage's runs went on: the host's busy CPU time
    over ``span_s`` less the ranks' own (never negative; ``/proc/stat`` counts in ticks).

        >>> others_cpus(1.5, 1.1, 0.5)
        0.8
    """
    return round(max(0.0, host_busy_s - own_cpu_s) / span_s, 3) if span_s > 0 else 0.0


def priced_stage_s(reference: ReferenceModel, spec: Any) -> tuple[float, int]:
    """What the cost model prices one run of :func:`tp_stage_s` at on ``spec`` (a rank's
    nodes, forward and backward, and every all-reduce on ``spec``'s tp link), and the
    collectives that run issues."""
    from lynx.planner.cost import allreduce_time, annotate_times
    from lynx.planner.tp_costs import rank_seconds

    compiled = reference.compiled
    tp, m = compiled.config.tp, compiled.config.microbatches
    graph = annotate_times(compiled.analysis.graph.copy(), spec)
    link = spec.links["tp"]
    compute = collectives = 0.0
    count = 0
    for _, attrs in graph.nodes(data=True):
        compute += rank_seconds(attrs, "forward_s", tp) + rank_seconds(attrs, "backward_s", tp)
        for nbytes in attrs.get("tp_allreduce", (0, 0)):
            if nbytes:
                collectives += allreduce_time(int(nbytes), tp, link)
                count += 1
    return m * (compute + collectives), m * count


def per_collective_s(measured_s: float, priced_s: float, collectives: int) -> float:
    """The measured run's excess over its price, per collective it issued (never negative).

    Example::

        >>> round(per_collective_s(0.010, 0.006, 64) * 1e6, 1)
        62.5
    """
    return max(0.0, measured_s - priced_s) / collectives if collectives else 0.0


def _worker(rank: int, gate: Any, world: int, port: int, compiled: Any, repeats: int, runs: int,
            timeout_s: float, ladder_repeats: int = 0, blocks: bool = False) -> tuple:
    """One rank (:func:`lynx.calibrate.forked.staged_rank` runs it): its stage, traced; then,
    once let go, per repeat the median wall seconds of its stage's graphs alone (with
    ``blocks``, each repeat when let go: :meth:`~lynx.calibrate.forked.Gate.next_block`); then
    (with ``ladder_repeats``) the all-reduce ladder on the ranks' gloo group
    (:func:`lynx.calibrate.allreduce.ladder_trips`; rank 0 returns it). Per repeat too, this
    rank's CPU seconds (every thread's) and, on rank 0, the host's busy seconds and the
    repeat's wall span, for :func:`others_cpus`."""
    import torch.distributed as dist

    import lynx
    from lynx.calibrate.forked import GO_WAIT_S, rank_env
    from lynx.calibrate.runtime import graphs_alone
    from lynx.runtime.report import host_busy_s   # the host's busy CPU, as a run's summary reads it

    torch.set_num_threads(1)
    rank_env(rank, world, port)
    captured = compiled.analysis.captured
    pipe = lynx.runtime.Pipeline(compiled, exit_on_error=False, timeout_s=timeout_s)
    graphs = graphs_alone(pipe.stage, dict(zip(captured.input_names, captured.example_inputs)),
                          compiled.config.microbatches)
    graphs()   # the joint graphs' traces, gloo's connections
    gate.prepared(GO_WAIT_S)
    out, cpu, busy, spans = [], [], [], []
    for r in range(repeats):
        if blocks:
            gate.next_block(rank, GO_WAIT_S)
        if blocks or not r:
            graphs()   # warm-up: the caches, after the wait (the code is warm: it ran before it)
        walls = []
        dist.barrier()
        host0, cpu0, start0 = host_busy_s(), time.process_time(), time.perf_counter()
        for _ in range(runs):
            dist.barrier()
            start = time.perf_counter()
            graphs()
            walls.append(time.perf_counter() - start)
        spans.append(time.perf_counter() - start0)
        cpu.append(time.process_time() - cpu0)
        host1 = host_busy_s()
        busy.append(None if host0 is None or host1 is None else host1 - host0)
        out.append(statistics.median(walls))   # the typical run: see the module docstring
        if blocks:
            gate.block_done()
    ladder = None
    if ladder_repeats:
        from lynx.calibrate.allreduce import ladder_trips

        world_group = dist.group.WORLD
        assert world_group is not None   # the pipeline's default group
        ladder = ladder_trips(world_group.group_name, ladder_repeats)
    pipe.close()
    host = None if None in busy else busy
    return (out, ladder, host, cpu, spans) if rank == 0 else (None, None, None, cpu, spans)
