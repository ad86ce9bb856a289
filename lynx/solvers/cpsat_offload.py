"""Offload in the CP-SAT model: a fourth choice per item, decided jointly with keep and recompute.

With copy lanes on the stage (:attr:`~lynx.solvers.problem.StageProblem.copies`), every item
that saves something and is not sent on gets ``f[i]`` — offloaded — exclusive with
``r[i]``. What it changes in :mod:`lynx.solvers.cpsat`'s model, following
:mod:`lynx.solvers.offload`'s accounting:

* **memory** — an offloaded item leaves the ``in_flight · kept`` term. What the first
  backpropagated group reads is prefetched in the microbatch's slot and held from the
  backward's start (added to every class's prefetched bytes ``P``); the rest is streamed and
  held from the start of the group above its read group down to its own group (added to that
  group's transient term ``T``). ``T`` also takes, per group, the bytes other microbatches'
  D2H copies still hold (:class:`~lynx.solvers.copies.StageCopies`: the pending terms, plus one
  group's copy in service, less what the lane drains while the groups above are
  backpropagated). Pinned host memory: ``in_flight · offloaded ≤ host budget``.
* **time** — per microbatch, the slot prefetch's seconds beyond the slot's slack; per group,
  the streamed prefetch's seconds beyond the backward of the group it is issued in (times
  the microbatches); on a synchronous link (a CPU) every copy's seconds.
* **validity** — an item recomputed in a window may read an offloaded item only if that one is
  prefetched in the slot (read by the first group); streamed values come during the backward.

Layer symmetry breaking is off when offload is on: pending copies and prefetch slots make
identical layers' positions matter.

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.cpsat import solve_model
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = with_copies(make_uniform_problem(layers=2, microbatches=4, in_flight=4, budget_fraction=0.3))
    >>> sol = solve_model(model_from_problem(p), time_limit_s=10.0)
    >>> sol.status, any(sol.offload)
    ('OPTIMAL', True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from lynx.solvers.copies import PrefetchSlot, StageCopies
from lynx.solvers.problem import StageProblem
from lynx.solvers.stage_model import OffloadItems

__all__ = ["OffloadVars", "add_offload", "forbid_window_readers", "with_copies"]

# time coefficients are fixed-point with this many steps per time unit
_SCALE = 1_000_000


@dataclass
class OffloadVars:
    """What :func:`add_offload` puts in the model."""

    f: dict[int, Any]
    kept_freed: Any            # Σ mem_w · f: leaves the in_flight · kept term
    slot_bytes: Any            # held from the backward's start (joins every class's P)
    per_group: list[Any]       # per group rank: streamed residency + pending copies
    exposed: Any               # copy seconds waited on, in time units


def add_offload(m: cp_model.CpModel, model: Any, off: OffloadItems, free: list[bool], r: list[Any],
                mem_w: list[int], unit: int, tau: float) -> OffloadVars:
    """Offload variables and their memory, host and time terms (see the module docstring)."""
    items, copies = model.items, off.copies
    f = {}
    for i in range(len(items)):
        if off.allowed[i] and free[i]:
            f[i] = m.new_bool_var(f"f{i}")
            m.add(r[i] + f[i] <= 1)
    total = sum(mem_w)
    size = {i: mem_w[i] for i in f}
    m.add(model.in_flight * sum(size[i] * v for i, v in f.items()) <= copies.host_budget_bytes // unit)
    kept_freed = sum(size[i] * v for i, v in f.items())
    slot_bytes = sum(size[i] * v for i, v in f.items() if not off.streamed(i))
    # streamed: held from the start of group read+1 down to its own group
    per_group: list[Any] = []
    out_bytes = [sum(size[i] * v for i, v in f.items() if items[i].group == g) for g in range(off.groups)]
    pending = None
    if not copies.synchronous and copies.pending and f:
        in_service = m.new_int_var(0, total, "in_service")
        for expr in out_bytes:
            m.add(in_service >= expr)
        pending = m.new_int_var(0, total * max(1, model.in_flight), "pending")
        m.add(pending >= in_service)
        # (a term's drain is negative where the copies' latency outweighs the lane's time: it
        # counts only when something is copied at all, as StageCopies.pending_bytes does)
        some = m.new_bool_var("some_offloaded")
        m.add_max_equality(some, list(f.values()))
        for counts, drained in copies.pending:
            terms = sum(c * out_bytes[g] for g, c in enumerate(counts) if c and g < off.groups)
            m.add(pending >= terms - int(drained // unit) + in_service).only_enforce_if(some)
    for q in range(off.groups):
        held = sum(size[i] * v for i, v in f.items()
                   if off.streamed(i) and items[i].group <= q <= off.read_group[i] + 1)
        if pending is not None:
            above = sum(copies.group_backward_s[g] for g in range(q + 1, off.groups)
                        if g < len(copies.group_backward_s))
            left = m.new_int_var(0, total * max(1, model.in_flight), f"pending_g{q}")
            m.add(left >= pending - int(copies.d2h_bytes_per_s * above // unit))
            held = held + left
        per_group.append(held)
    exposed = _exposed(m, off, f, size, unit, tau)
    return OffloadVars(f, kept_freed, slot_bytes, per_group, exposed)


def forbid_window_readers(m: cp_model.CpModel, model: Any, off: OffloadItems, offv: OffloadVars,
                          x: list[dict[tuple[int, int], Any]]) -> None:
    """An item recomputed in a window may not read an item whose prefetch comes only during
    the backward (streamed)."""
    for i, item in enumerate(model.items):
        for u, _cross in item.inputs:
            if u not in offv.f or not off.streamed(u):
                continue
            for xc in x:
                for (j, _k), v in xc.items():
                    if j == i:
                        m.add(v <= 1 - offv.f[u])


def _exposed(m: cp_model.CpModel, off: OffloadItems, f: dict[int, Any], size: dict[int, int], unit: int,
             tau: float) -> Any:
    """Copy seconds waited on per step, in units of ``tau`` (latency per copy left out)."""
    copies = off.copies
    if not f:
        return 0
    per_unit_h2d = unit / copies.h2d_bytes_per_s / tau     # time units per byte unit
    if copies.synchronous:
        per_unit = per_unit_h2d + unit / copies.d2h_bytes_per_s / tau
        spent = m.new_int_var(0, int(per_unit * sum(size.values()) * off.microbatches) + 1, "copy_sync")
        m.add(spent * _SCALE >= round(per_unit * _SCALE) * off.microbatches * sum(size[i] * v for i, v in f.items()))
        return spent
    horizon = int(sum(size.values()) * per_unit_h2d) + 1
    terms = []
    slot = sum(size[i] * v for i, v in f.items() if not off.streamed(i))
    slacks: dict[int, int] = {}
    for s in copies.slots:
        slack = int((s.slack_s if s is not None else 0.0) / tau)
        slacks[slack] = slacks.get(slack, 0) + 1
    for slack, count in sorted(slacks.items()):
        e = m.new_int_var(0, horizon, f"copy_slot_{slack}")
        m.add(e * _SCALE >= round(per_unit_h2d * _SCALE) * slot - slack * _SCALE)
        terms.append(count * e)
    for q in range(off.groups):
        issued = [size[i] * v for i, v in f.items() if off.streamed(i) and off.read_group[i] + 1 == q]
        if not issued:
            continue
        room = int(copies.group_backward_s[q] / tau) if q < len(copies.group_backward_s) else 0
        e = m.new_int_var(0, horizon, f"copy_g{q}")
        m.add(e * _SCALE >= round(per_unit_h2d * _SCALE) * sum(issued) - room * _SCALE)
        terms.append(off.microbatches * e)
    return sum(terms)


def with_copies(problem: StageProblem, *, bytes_per_s: float = 2e11, slack_s: float = 1e-3,
                host_budget_bytes: int = 2**50) -> StageProblem:
    """``problem`` with copy lanes of ``bytes_per_s`` each way (synthetic problems, tests): every
    microbatch's slot has ``slack_s``, each group's backward twice its nodes' recompute time and
    its forward their recompute time, nothing pending."""
    from lynx.solvers.problem import group_key, group_ranks

    ranks = group_ranks(problem)
    backward = [0.0] * len(ranks)
    for n in problem.nodes:
        backward[ranks[group_key(n)]] += 2 * n.recompute_s
    first = problem.windows[0].id if problem.windows else None
    from lynx.planner.windows import WindowId

    slots = tuple(PrefetchSlot(window=WindowId.recv(problem.stage, "recv_grad", j) if first is None else
                               next((w.id for w in problem.windows if w.microbatch == j),
                                    WindowId.recv(problem.stage, "recv_grad", j)), slack_s=slack_s)
                  for j in range(problem.microbatches))
    copies = StageCopies(d2h_bytes_per_s=bytes_per_s, h2d_bytes_per_s=bytes_per_s, alpha_s=0.0, synchronous=False,
                         host_budget_bytes=host_budget_bytes, slots=slots, group_backward_s=tuple(backward),
                         group_forward_s=tuple(b / 2 for b in backward))
    return dataclasses.replace(problem, copies=copies)
