"""The runtime's own host cost per pipeline action, measured on :class:`lynx.runtime.Pipeline` itself.

A reference compiled for 2 stages (:class:`~lynx.calibrate.cpu.ReferenceModel` with ``pp=2``:
gpt-tiny at seq 4 × 1, 4 microbatches, nothing recomputed, so its graphs are short and the
runtime's share of a step is large) is trained for real by ``lynx.runtime.Pipeline`` on two
processes of this host, forked from this one (gloo on 127.0.0.1, a port of their own), each
pinned to a core of its own where there are two (:func:`lynx.calibrate.forked.pin_to_core`:
as the main job's ranks run, a core each). Per step, each rank measures directly:

- the runtime's work on the rank's critical path: the main thread's CPU time of the step less
  the CPU time of the graph calls inside it (``forward_step``, ``backward_step``, the stage's
  ``backward_weight`` and ``release``, which the rates and the op overhead price: timed by
  wrapping them in the forked rank, :class:`_GraphClock`) — scheduling, posting and completing
  sends and receives, the loss, the statistics;
- the CPU time of the process's other threads during the step (a waiter per message, gloo's):
  the work the runtime adds beside it, which takes a core from some rank where none is spare.

Each is divided by the actions of the rank's list (:func:`lynx.planner.schedule.list_actions`:
its forwards and backwards and the sends and receives it posts, 4 per microbatch here) and
averaged over the two ranks; per repeat, the least over ``steps`` steps (other load only adds
to CPU time, through the caches it shares), and the figure is the best repeat. The timeline
charges that much per action of every device's list.

Why measured inside the step, not as a difference: the previous measure, a step's CPU time
less that of the same graphs run alone (the least of 8 of each), was a difference of two
minima of ~15 ms that differ by ~3 ms, so 5% of noise in either moved the figure 25%: three
calibrations on a quiet machine read 158, 229 and 217 µs per action. Timing the graph calls
within the step leaves only the runtime's own ~3 ms to vary, on the same step, and needs no
graphs-alone runs (half the time). What it leaves out: the graphs inside a step ran 20-90 µs
per action slower than alone (caches cooled by the waits), a spread that did not repeat run to
run; the main job's prediction sat at 0.96 of the measured step without it.

Example (forks two processes; a few seconds)::

    >>> from lynx.calibrate.cpu import ReferenceModel
    >>> from lynx.calibrate.runtime import runtime_action_s
    >>> small = ReferenceModel(seq=4, microbatch=1, pp=2)                  # doctest: +SKIP
    >>> main, threads = runtime_action_s(small, repeats=1, steps=2)        # doctest: +SKIP
    >>> 0 < main[0] < 0.01 and 0 <= threads[0] < 0.01                      # doctest: +SKIP
    True
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Any, NamedTuple

import torch

from lynx.calibrate.cpu import ReferenceModel
from lynx.errors import LynxRuntimeError

__all__ = ["runtime_action_s", "start_runtime_action_s", "runtime_action_results", "RuntimeMeasured", "graphs_alone"]


class RuntimeMeasured(NamedTuple):
    """What the ranks of :func:`start_runtime_action_s` measured: per repeat, the runtime's
    main-thread and other-thread seconds per action; and the link's ``(alphas, betas)`` per
    repeat (:func:`lynx.calibrate.links.link_trips`), or None when not asked for."""

    main: list[float]
    threads: list[float]
    link: tuple[list[float], list[float]] | None


def runtime_action_s(reference: ReferenceModel, repeats: int = 5, steps: int = 8, warmups: int = 2,
                     timeout_s: float = 120.0) -> tuple[list[float], list[float]]:
    """Per repeat: the runtime's main-thread seconds per action of a rank's list, and its other
    threads' CPU seconds per action (module docstring). Needs ``fork`` (Linux, macOS)."""
    with start_runtime_action_s(reference, repeats, steps, warmups, timeout_s) as started:
        measured = runtime_action_results(reference, started)
    return measured.main, measured.threads


def start_runtime_action_s(reference: ReferenceModel, repeats: int = 5, steps: int = 8, warmups: int = 2,
                           timeout_s: float = 120.0, link_repeats: int = 0) -> Any:
    """Fork the two ranks: they build the pipeline and run its ``warmups`` steps (the traces),
    then wait for :func:`runtime_action_results` to let them measure
    (:class:`lynx.calibrate.forked.Staged`); with ``link_repeats``, they time the gloo link
    between them after their steps, ``link_repeats`` repeats (:mod:`lynx.calibrate.links`):
    two processes on a core each, as the link's own ranks were, without forking and joining
    a group for it (~1 s of a calibration)."""
    if not hasattr(os, "fork"):
        raise LynxRuntimeError("measuring the runtime's own cost forks two ranks of this process; this platform "
                               "has no fork")
    from lynx.calibrate.forked import Staged
    from lynx.runtime.topology import free_port

    compiled = reference.compiled
    return Staged(_worker, compiled.config.pp, (compiled.config.pp, free_port(), compiled, repeats, steps, warmups,
                                                 timeout_s, link_repeats), timeout_s)


def runtime_action_results(reference: ReferenceModel, started: Any) -> RuntimeMeasured:
    """What the ranks of :func:`start_runtime_action_s` measured, per repeat and per action."""
    from lynx.planner.schedule import list_actions

    config = reference.compiled.config
    pp = config.pp
    actions = [list_actions(config.schedule, pp, config.microbatches, rank) for rank in range(pp)]
    from lynx.calibrate.forked import why_not

    items, missing = started.results()
    results: dict[int, Any] = dict(items)
    errors = why_not(results, missing)
    if errors or len(results) != pp:
        raise LynxRuntimeError(f"could not run lynx.runtime.Pipeline on {pp} processes to measure its own cost: "
                               f"{errors or 'a rank sent no result'}")
    steps = {s: results[s][0] for s in range(pp)}
    repeats = len(steps[0])
    main = [statistics.mean(steps[s][r][0] / actions[s] for s in range(pp)) for r in range(repeats)]
    threads = [statistics.mean(steps[s][r][1] / actions[s] for s in range(pp)) for r in range(repeats)]
    return RuntimeMeasured(main, threads, results[0][1])


class _GraphClock:
    """This thread's CPU seconds in the graph calls of ``pipe``'s steps since :meth:`reset`:
    the runner's ``forward_step`` and ``backward_step`` and its stages' ``backward_weight`` (a
    ``B`` that sends its input gradients first runs its weight part there) and ``release``,
    wrapped in this (forked, measuring) process only."""

    def __init__(self, pipe: Any) -> None:
        import lynx.runtime.runner as runner

        self.seconds = 0.0
        runner.forward_step = self._timed(runner.forward_step)
        runner.backward_step = self._timed(runner.backward_step)
        for chunk in pipe.chunks.values():
            chunk.release = self._timed(chunk.release)
            chunk.backward_weight = self._timed(chunk.backward_weight)

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
        return timed

    def reset(self) -> None:
        self.seconds = 0.0


def _worker(rank: int, gate: Any, world: int, port: int, compiled: Any, repeats: int, steps: int, warmups: int,
            timeout_s: float, link_repeats: int = 0) -> tuple[list[tuple[float, float]], Any]:
    """One rank (:func:`lynx.calibrate.forked.staged_rank` runs it): the pipeline and its
    warm-up steps; then, once let go, per repeat the least main-thread CPU seconds of a step
    outside its graph calls, and the least other-thread CPU seconds of a step; then (with
    ``link_repeats``) the gloo link's round trips between the two ranks, each on its core
    (:func:`lynx.calibrate.links.link_trips`; rank 0 returns them)."""
    import lynx
    from lynx.calibrate.forked import GO_WAIT_S, pin_to_core, rank_env

    pin_to_core(rank)   # before any thread starts: gloo's and the waiters inherit it
    torch.set_num_threads(1)
    rank_env(rank, world, port)
    m = compiled.config.microbatches
    batch = [torch.cat([x] * m) for x in compiled.analysis.captured.example_inputs]  # the step's m microbatches
    pipe = lynx.runtime.Pipeline(compiled, exit_on_error=False, timeout_s=timeout_s)
    graphs = _GraphClock(pipe)
    for _ in range(warmups):
        pipe.step(*batch)   # warm-up: the joint graphs' traces, the gloo pairs' connections
    gate.prepared(GO_WAIT_S)
    pipe.step(*batch)       # the caches, after the wait
    out = []
    for _ in range(repeats):
        main, threads = float("inf"), float("inf")
        for _ in range(steps):
            graphs.reset()
            cpu, process = time.thread_time(), time.process_time()
            pipe.step(*batch)
            cpu, process = time.thread_time() - cpu, time.process_time() - process
            main, threads = min(main, max(0.0, cpu - graphs.seconds)), min(threads, max(0.0, process - cpu))
        out.append((main, threads))
    link = None
    if link_repeats and world == 2:
        import torch.distributed as dist

        from lynx.calibrate.links import CALIBRATION_SMALL_TRIPS, link_trips
        from lynx.torch_private import default_store

        # a gloo group of the two ranks' own, as lynx.calibrate.links makes it (the pipeline's
        # store, a prefix of its own): the same point-to-point calls on the same kind of group
        store = dist.PrefixStore("lynx-calibrate-link", default_store())
        group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))
        link = link_trips(group, rank, link_repeats, small_trips=CALIBRATION_SMALL_TRIPS)
    pipe.close()
    return out, (link if rank == 0 else None)


def graphs_alone(stage: Any, inputs: dict[str, torch.Tensor], m: int) -> Any:
    """A step's forwards and backwards of ``stage`` with nothing sent: received values and the
    gradients of sent ones are made up once, in their shapes."""
    from lynx.runtime.p2p import boundary_meta
    from lynx.runtime.step import as_received, backward_step, forward_step, needs_grad

    received = [torch.randn(meta.shape).to(meta.dtype) for meta in boundary_meta(stage.gm, stage.spec.recv)]

    def run() -> None:
        flights = [forward_step(stage, j, inputs, as_received(received)) for j in range(m)]
        for j, flight in enumerate(flights):
            grads = None if stage.spec.is_last else [torch.ones_like(o) if needs_grad(o) else None
                                                     for o in flight.output]
            backward_step(stage, j, flight, grads, 1.0 / m)
            stage.release(j)

    return run
