"""The runtime's own host cost per pipeline action, measured on :class:`lynx.runtime.Pipeline` itself.

A reference compiled for 2 stages (:class:`~lynx.calibrate.cpu.ReferenceModel` with ``pp=2``:
gpt-tiny at seq 4 × 1, 4 microbatches, nothing recomputed, so its graphs are short and the
runtime's share of a step is large) is trained for real by ``lynx.runtime.Pipeline`` on two
processes of this host, forked from this one (gloo on 127.0.0.1, a port of their own). Each
rank alternates a training step with the same microbatches' forwards and backwards through its
stage alone (the boundary values made up in place, nothing sent), so both run under the same
load, and per repeat keeps the least CPU time of each over ``steps`` rounds:

- the main thread's CPU time of a step less that of its graphs alone is the runtime's work on
  the rank's critical path: scheduling, posting and completing sends and receives, the loss,
  the statistics;
- the CPU time of the process's other threads during a step (a waiter per message, gloo's) is
  the work the runtime adds beside it, which takes a core from some rank where none is spare.

Both are divided by the actions of the rank's list (:func:`lynx.planner.schedule.rank_actions`:
its forwards and backwards and the sends and receives it posts, 4 per microbatch here) and
averaged over the two ranks: the timeline charges that much per action of every device's list.
CPU time leaves out the time other processes hold the core.

Example (forks two processes; a few seconds)::

    >>> from lynx.calibrate.cpu import ReferenceModel
    >>> from lynx.calibrate.runtime import runtime_action_s
    >>> small = ReferenceModel(seq=4, microbatch=1, pp=2)                  # doctest: +SKIP
    >>> main, threads = runtime_action_s(small, repeats=1, steps=2)        # doctest: +SKIP
    >>> 0 < main[0] < 0.01 and 0 <= threads[0] < 0.01                      # doctest: +SKIP
    True
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

from lynx.calibrate.cpu import ReferenceModel
from lynx.errors import LynxRuntimeError

__all__ = ["runtime_action_s", "graphs_alone"]


def runtime_action_s(reference: ReferenceModel, repeats: int = 5, steps: int = 8,
                     timeout_s: float = 120.0) -> tuple[list[float], list[float]]:
    """Per repeat: the runtime's main-thread seconds per action of a rank's list, and its other
    threads' CPU seconds per action (module docstring). Needs ``fork`` (Linux, macOS)."""
    if not hasattr(os, "fork"):
        raise LynxRuntimeError("measuring the runtime's own cost forks two ranks of this process; this platform "
                               "has no fork")
    from lynx.calibrate.forked import collect
    from lynx.runtime.topology import free_port

    from lynx.planner.schedule import list_actions

    compiled = reference.compiled
    pp = compiled.config.pp
    actions = [list_actions(compiled.config.schedule, pp, compiled.config.microbatches, rank) for rank in range(pp)]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, pp, port, compiled, repeats, steps, timeout_s, queue),
                         daemon=True) for rank in range(pp)]
    items, missing = collect(procs, queue, len(procs), timeout_s)
    results: dict[int, Any] = dict(items)
    errors = [r for r in results.values() if isinstance(r, str)] + ([missing] if missing else [])
    if errors or len(results) != pp:
        raise LynxRuntimeError(f"could not run lynx.runtime.Pipeline on {pp} processes to measure its own cost: "
                               f"{'; '.join(errors) or 'a rank sent no result'}")
    main, threads = [], []
    for r in range(repeats):
        main.append(statistics.mean(results[s][r][0] / actions[s] for s in range(pp)))
        threads.append(statistics.mean(results[s][r][1] / actions[s] for s in range(pp)))
    return main, threads


def _worker(rank: int, world: int, port: int, compiled: Any, repeats: int, steps: int, timeout_s: float,
            queue: Any) -> None:
    """One rank: per repeat, the least main-thread CPU seconds of a step beyond its graphs', and
    the least other-thread CPU seconds of a step."""
    try:
        import lynx

        torch.set_num_threads(1)
        for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
            del os.environ[name]  # under torchrun the store would be its agent's, not this job's own
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        m = compiled.config.microbatches
        captured = compiled.analysis.captured
        batch = [torch.cat([x] * m) for x in captured.example_inputs]  # the step's m microbatches
        pipe = lynx.runtime.Pipeline(compiled, exit_on_error=False, timeout_s=timeout_s)
        graphs = graphs_alone(pipe.stage, dict(zip(captured.input_names, captured.example_inputs)), m)
        for _ in range(3):
            pipe.step(*batch)   # warm-up: the joint graphs' traces, the gloo pairs' connections
            graphs()
        out = []
        for _ in range(repeats):
            alone, main, threads = float("inf"), float("inf"), float("inf")
            for _ in range(steps):
                cpu = time.thread_time()
                graphs()
                alone = min(alone, time.thread_time() - cpu)
                cpu, process = time.thread_time(), time.process_time()
                pipe.step(*batch)
                cpu, process = time.thread_time() - cpu, time.process_time() - process
                main, threads = min(main, cpu), min(threads, max(0.0, process - cpu))
            out.append((max(0.0, main - alone), threads))
        pipe.close()
        queue.put((rank, out))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises a LynxRuntimeError
        queue.put((rank, f"rank {rank}: {type(err).__name__}: {err}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # no interpreter teardown with the group's threads alive (see lynx.process_group_guard)


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
