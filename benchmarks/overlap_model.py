"""No-noise event model of a pipeline step with window vs on-demand recomputation.

``benchmarks/overlap_cpu.py`` prints, next to what it measured, what this model gives for
the costs it measured: the best ratio the setting allows (the *ceiling*), before any noise.
Each stage runs its 1F1B (or GPipe) actions in order on one compute resource; each direction
of each link carries one boundary transfer at a time, ``transfer_ms`` each (no latency, no
jitter). Variants differ only in where a stage's recomputation ``r`` of microbatch j runs:

* ``none``       no recomputation;
* ``on-demand``  after the gradient of j has arrived, before B(j) (what backward unpacking does;
                 also ``torch.utils.checkpoint``);
* ``lynx``       in the window before B(j): as soon as the stage is free after its previous
                 action, while the gradient is in flight (whatever runs past its arrival is
                 exposed, as on the real runtime).

With two stages the ceiling has a closed form: stage 0 holds two microbatches, so its period
per microbatch is ``max((RT + S0 + R_od) / 2, S0 + R, S1)`` with ``RT = 2·transfer + S1`` the
round trip, ``S = f + b``, and ``R_od`` = R on demand, 0 when hidden; Lynx gains most at
``RT = S0 + 2R``, where ``lynx/on-demand = 2(S0 + R) / (2·S0 + 3R)``; below that stage 0 is
saturated (the ratio rises steeply to 1 at ``RT = S0 + R``), above it the round trip dilutes
the gain (slowly). :func:`best_transfer_ms` gives that point.

Example::

    >>> c = [Stage(15, 14, 15), Stage(16, 17)]
    >>> round(simulate(c, 15.0, 8)["lynx/on-demand"], 3)
    0.873
    >>> round(best_transfer_ms(c), 1)
    13.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Stage", "best_transfer_ms", "simulate", "sweep"]

VARIANTS = ("none", "on-demand", "lynx")


@dataclass(frozen=True)
class Stage:
    """One microbatch of one stage, ms: forward, backward (keeping everything), recompute of
    what the plan drops."""

    f: float
    b: float
    r: float = 0.0

    def scaled(self, k: float) -> Stage:
        return Stage(self.f * k, self.b * k, self.r * k)


def _actions(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    from lynx.planner.schedule import stage_actions

    return [(a.kind, a.microbatch) for a in stage_actions(schedule, stage=stage, stages=stages, microbatches=m)]


def _run(stages: list[Stage], transfer_ms: float, m: int, variant: str, schedule: str) -> tuple[float, float]:
    """Step time and Lynx's exposed window time (ms) for one variant."""
    p = len(stages)
    todo = [_actions(schedule, s, p, m) for s in range(p)]
    pos = [0] * p
    free = [0.0] * p                     # when each stage's compute is next free
    act = [{} for _ in range(p)]     # act[s][j]: when stage s has microbatch j's input
    grad = [{} for _ in range(p)]    # grad[s][j]: when stage s has j's output gradient
    link_f = [0.0] * p                   # link s -> s+1 busy until
    link_b = [0.0] * p                   # link s+1 -> s busy until
    exposed = 0.0
    for j in range(m):
        act[0][j] = 0.0
    for j in range(m):
        grad[p - 1][j] = None            # the last stage's loss: ready after its forward
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(todo[s]):
                kind, j = todo[s][pos[s]]
                c = stages[s]
                if kind == "F":
                    if j not in act[s]:
                        break
                    t = max(free[s], act[s][j]) + c.f
                    free[s] = t
                    if s + 1 < p:
                        link_f[s] = max(link_f[s], t) + transfer_ms
                        act[s + 1][j] = link_f[s]
                else:
                    if s + 1 < p and j not in grad[s]:
                        break
                    arrive = grad[s][j] if s + 1 < p else free[s]
                    if variant == "none":
                        t = max(free[s], arrive) + c.b
                    elif variant == "on-demand":
                        t = max(free[s], arrive) + c.r + c.b
                    else:
                        done = free[s] + c.r
                        exposed += max(0.0, done - max(arrive, free[s])) if c.r else 0.0
                        t = max(done, arrive) + c.b
                    free[s] = t
                    if s > 0:
                        link_b[s - 1] = max(link_b[s - 1], t) + transfer_ms
                        grad[s - 1][j] = link_b[s - 1]
                pos[s] += 1
                progress = True
    if any(pos[s] < len(todo[s]) for s in range(p)):
        raise RuntimeError("event model deadlocked (schedule / stage count mismatch)")
    return max(free), exposed


def simulate(stages: list[Stage], transfer_ms: float, microbatches: int, *, schedule: str = "1f1b",
             tail_ms: float = 0.0) -> dict[str, float]:
    """Step time (ms) of each variant, Lynx's exposed window time, and ``lynx/on-demand``.
    ``tail_ms`` is added to every variant (e.g. a data-parallel collective after the last
    backward, the same for all)."""
    out: dict[str, float] = {}
    for variant in VARIANTS:
        step, exposed = _run(stages, transfer_ms, microbatches, variant, schedule)
        out[variant] = step + tail_ms
        if variant == "lynx":
            out["lynx_exposed"] = exposed
    out["lynx/on-demand"] = out["lynx"] / out["on-demand"]
    out["lynx/none"] = out["lynx"] / out["none"]
    return out


def best_transfer_ms(stages: list[Stage]) -> float:
    """The transfer time where two-stage 1F1B gives Lynx the most (``RT = S0 + 2R``)."""
    s0, s1 = stages[0], stages[-1]
    return max(0.0, (s0.f + s0.b + 2 * s0.r - (s1.f + s1.b)) / 2)


def sweep(stages: list[Stage], transfers_ms: list[float], microbatches: int, **kw: object) -> list[tuple[float, float]]:
    """``(transfer ms, lynx/on-demand)`` for each transfer time."""
    return [(x, simulate(stages, x, microbatches, **kw)["lynx/on-demand"]) for x in transfers_ms]
