"""The single-process reference: all stages of a pipeline in one process, each in its schedule's order.

The same stage modules, the same per-stage action order and the same window recompute as
:class:`lynx.runtime.Pipeline`, without communication. Tests compare its gradients with the
original model's and with the runtime's, and its measured saved bytes with the plan's.

Example::

    >>> import lynx
    >>> from lynx.frontend.capture import capture
    >>> from lynx.rewrite import build_stages
    >>> from lynx.testing import run_local
    >>> model, (idx, tgt) = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> gm = capture(model, (idx, tgt)).gm
    >>> ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    >>> stages = build_stages(gm, [ops[:70], ops[70:]])
    >>> losses = run_local(stages, [{"idx": idx, "targets": tgt}] * 2)
    >>> len(losses)
    2
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from lynx.planner.schedule import Action, Op, compute_order
from lynx.runtime.step import InFlight, as_received, backward_step, forward_step

__all__ = ["run_local", "Prefetch"]

# (stage index, microbatch) -> windows in order, each a list of node names to recompute (or, offloaded,
# bring back from host memory) before B
Prefetch = Callable[[int, int], Sequence[Sequence[str]]]


def _rng_state() -> tuple:
    """The CPU generator's state and, where CUDA is initialised, every GPU's."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def run_local(stages: Sequence, microbatches: Sequence[Mapping[str, torch.Tensor]], *, schedule: str = "1f1b",
              prefetch: Prefetch | None = None, loss_scale: float = 1.0,
              stage_seeds: Sequence[int] | None = None, pp: int | None = None) -> list[torch.Tensor]:
    """Forward and backward every microbatch through ``stages``; returns the losses (detached).

    ``schedule`` is a schedule of :mod:`lynx.planner.schedule` — each device runs its compute
    order; ``stages`` are the model chunks in pipeline order, ``pp`` devices (default: one chunk
    each); a zero-bubble ``I`` runs the whole backward and its ``W`` nothing — or
    ``"sequential"`` (one microbatch at a time through every stage: the order an unsplit model
    runs in, so its dropout draws match).
    With ``stage_seeds`` each stage draws random numbers from its own generators seeded
    ``stage_seeds[s]``, as each rank of a distributed run does (``torch.manual_seed`` on a rank
    seeds its CUDA generators too, so where CUDA is initialised their states are swapped as
    well as the CPU's).
    """
    p, m = len(stages), len(microbatches)
    if schedule == "sequential":
        queues: list[list[Action]] = [[] for _ in range(p)]
        order = [(s, a) for j in range(m) for s, a in
                 [(s, Action(Op.FORWARD, s, j)) for s in range(p)]
                 + [(s, Action(Op.BACKWARD, s, j)) for s in reversed(range(p))]]
    else:
        devices = pp or p
        by_device = compute_order(schedule, devices, m, virtual=p // devices)
        queues = [[a for a in acts if a.op is not Op.BACKWARD_WEIGHT] for acts in by_device]
        order = None
    rng = None
    if stage_seeds is not None:
        outer = _rng_state()
        rng = []
        for seed in stage_seeds:
            torch.manual_seed(seed)
            rng.append(_rng_state())
        _set_rng_state(outer)
    sent: dict[tuple[int, int], list[torch.Tensor]] = {}       # (stage, mb) -> values for stage+1
    grads: dict[tuple[int, int], list] = {}                    # (stage, mb) -> grads for stage-1
    flights: dict[tuple[int, int], InFlight] = {}
    losses: dict[int, torch.Tensor] = {}

    def ready(s: int, kind: str, j: int) -> bool:
        if kind == "F":
            return s == 0 or (s - 1, j) in sent
        return s == p - 1 or (s + 1, j) in grads

    def run(s: int, kind: str, j: int) -> None:
        stage = stages[s]
        if rng is not None:
            caller_rng = _rng_state()
            _set_rng_state(rng[s])
        try:
            if kind == "F":
                received = as_received(sent.pop((s - 1, j))) if s > 0 else []
                flight = forward_step(stage, j, microbatches[j], received)
                flights[(s, j)] = flight
                if stage.spec.is_last:
                    losses[j] = flight.output.detach()
                else:
                    sent[(s, j)] = list(flight.output)
            else:
                offloaded = getattr(stage, "offload", {})
                for nodes in (prefetch(s, j) if prefetch else ()):
                    # a window brings back offloaded values from the host and recomputes dropped ones
                    fetch = [n for n in nodes if n in offloaded]
                    if fetch:
                        stage.prefetch(j, fetch)
                    if len(fetch) < len(nodes):
                        stage.recompute(j, [n for n in nodes if n not in offloaded])
                g = grads.pop((s + 1, j)) if s < p - 1 else None
                back = backward_step(stage, j, flights.pop((s, j)), g, loss_scale)
                if s > 0:
                    grads[(s, j)] = back
                stage.release(j)
        finally:
            if rng is not None:
                rng[s] = _rng_state()
                _set_rng_state(caller_rng)

    if order is not None:
        params = list(dict.fromkeys(p for stage in stages for p in stage.parameters()))
        for s, action in order:
            kind, j = action.kind, action.microbatch
            if kind == "B" and s == p - 1:
                # Accumulate this microbatch's gradients apart, then add them to the earlier ones,
                # as the unsplit model does: a weight used by two stages (tied embeddings) then gets
                # G + (g_head + g_embedding), not (G + g_head) + g_embedding.
                stash = [param.grad for param in params]
                for param in params:
                    param.grad = None
            run(s, kind, j)
            if kind == "B" and s == 0:
                for param, before in zip(params, stash):
                    if before is not None:
                        param.grad = before if param.grad is None else before + param.grad
    while any(queues):
        progressed = False
        for d in range(len(queues)):
            if queues[d] and ready(queues[d][0].chunk, _kind(queues[d][0]), queues[d][0].microbatch):
                action = queues[d].pop(0)
                run(action.chunk, _kind(action), action.microbatch)
                progressed = True
        if not progressed:  # pragma: no cover - the schedules above never deadlock
            raise RuntimeError("local pipeline deadlocked")
    return [losses[j] for j in range(m)]


def _kind(action: Action) -> str:
    """F, or B for a whole backward (a zero-bubble ``I`` runs all of it here)."""
    return "F" if action.op is Op.FORWARD else "B"
