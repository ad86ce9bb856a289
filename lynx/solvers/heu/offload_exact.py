"""HEU with offload at the tightest budgets: the dear values below the top group, and exact books.

:func:`lynx.solvers.heu.offload.solve_heu_offload` solves the recompute problem of what an offload
set leaves on the device under the stage's budget less :func:`~lynx.solvers.offload.offload_overhead`
— a bound that adds, to the rest's own peak, the prefetched values, the streamed ones held over two
groups and the copies still pending, as if each peaked at once. At the tightest budgets (level 0.0:
`full`'s peak, where the budget is mostly one layer regenerated on demand) that sum leaves the rest
nothing, though the rest's peak (a layer regenerated) and the copies' (the layer above's values
coming back) fall on different backward steps. Measured on gpt-20b, a100-80g, pp 8, tp 1, 8
microbatches, stage 3: offloading the layers' matmul outputs and boundaries below the top group
needs 971 MiB of overhead by the bound, leaving 1437 MiB of 2408 — the rest does not fit — while
the exact peak of the joined plan (:func:`~lynx.solvers.memory.peak_activation_bytes`, the copies
pending by the solvers' bound) is 2120 MiB, and it exposes 213 ms instead of HEU's 424 ms.

* :func:`dear_set` — the offload set of that shape: the offloadable values a later group reads
  (the boundaries) and those dearer to recompute per byte than the stage's average (a layer's
  matmul outputs), none of the first-backpropagated group: its values would come back at the
  backward's start, on top of the copies of the forward just before, so that group is left to
  recomputation (in a window where one serves the microbatch). Stages holding more than one
  microbatch only (one holding one must drain its copies by the forward's end, which the other
  sets check per node).
* :func:`exact_left` — the budget the rest of a set may use, measured instead of bounded: the
  stage's budget less what the set adds to the exact peak of the leanest plan (Megatron-full's
  kept set, the rest on demand) — or None where even that joined plan does not fit. A rest
  solved under it is checked whole, exactly (:func:`lean_with_offload` is the fallback).

Example::

    >>> from lynx.solvers.cpsat_offload import with_copies
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=4, budget_fraction=0.3))
    >>> chosen = dear_set(p)
    >>> sorted({n.layer for n in p.nodes if n.name in chosen})   # not the top layer
    [0, 1, 2]
"""

from __future__ import annotations

from lynx.solvers.baselines import layer_recompute_set
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.memory_regen import per_node_tuple   # (the solvers' per-node-tuple cache)
from lynx.solvers.offload import offloadable, read_groups, slot_prefetch
from lynx.solvers.problem import Assignment, StageProblem, group_key, group_ranks

__all__ = ["dear_set", "fitting_dear_set", "exact_left", "lean", "lean_with_offload", "tight", "TIGHT"]


# the dear set is tried where the budget is at most this much the leanest plan's peak (level 0.0
# and near: 1.0-3.6x on gpt-20b h100 pp 4; level 0.3 there 8-13x, where it never won and its
# rest, its top layer unlike the others, cost HEU 11% more work)
TIGHT = 4.0


def lean(problem: StageProblem) -> frozenset[str]:
    """Megatron-full's recomputed set of the stage (it follows the groups, not the bytes: once per stage)."""
    return per_node_tuple("lean", problem, layer_recompute_set)


def tight(problem: StageProblem, plain: StageProblem, lean: frozenset[str]) -> bool:
    """Whether the stage's budget is within ``TIGHT`` of the peak of its leanest plan without
    offload (``plain``: the stage without copy lanes; ``lean``: Megatron-full's recomputed set)."""
    return problem.activation_budget_bytes <= TIGHT * peak_activation_bytes(plain, Assignment(lean))


def dear_set(problem: StageProblem) -> frozenset[str]:
    """The boundaries and the values dearer than average to recompute per byte, below the top
    group, within the host budget (see the module docstring); empty where none or on a stage
    holding one microbatch."""
    copies = problem.copies
    if copies is None or problem.in_flight < 2:
        return frozenset()
    allowed = set(offloadable(problem))
    can = [n for n in problem.nodes if n.saved_bytes > 0 and n.name in allowed]
    if not can:
        return frozenset()
    ranks, reads = group_ranks(problem), read_groups(problem)
    top = max(ranks.values())
    average = sum(n.recompute_s for n in can) / sum(n.saved_bytes for n in can)
    host = copies.host_budget_bytes // problem.in_flight
    chosen = []
    for n in can:
        own = ranks[group_key(n)]
        if reads[n.name] == top or n.saved_bytes > host:   # (read by the top group: not streamed)
            continue
        if reads[n.name] > own or n.recompute_s > average * n.saved_bytes:
            host -= n.saved_bytes
            chosen.append(n.name)
    return frozenset(chosen)


def fitting_dear_set(problem: StageProblem, lean: frozenset[str]) -> frozenset[str]:
    """:func:`dear_set`, less the fewest of its dear values (not its boundaries) from the top group
    down, largest first, that its leanest plan fits the budget with (:func:`exact_left` not None):
    the copies a forward's top groups offload are still pending at the next backward's start,
    and a group's values come back while the group above is backpropagated, so the dear values
    of the upper groups cost the most device memory. Unchanged where the whole set fits, or
    where its boundaries alone do not (found by bisection: a few exact peaks, tight stages only)."""
    dear = dear_set(problem)
    if not dear or _lean_fits(problem, dear, lean):
        return dear
    ranks, reads = group_ranks(problem), read_groups(problem)
    own = {n.name: ranks[group_key(n)] for n in problem.nodes}
    at = {n.name: i for i, n in enumerate(problem.nodes)}
    size = {n.name: n.saved_bytes for n in problem.nodes}
    values = sorted((name for name in dear if reads[name] <= own[name]),   # (not a boundary)
                    key=lambda name: (-own[name], -size[name], -at[name]))
    if not values or not _lean_fits(problem, dear - frozenset(values), lean):
        return dear
    low, high = 0, len(values)   # dear less values[:high] fits, less values[:low] does not
    while high - low > 1:
        mid = (low + high) // 2
        if _lean_fits(problem, dear - frozenset(values[:mid]), lean):
            high = mid
        else:
            low = mid
    return dear - frozenset(values[:high])


def _lean_fits(problem: StageProblem, chosen: frozenset[str], lean: frozenset[str]) -> bool:
    """Whether the leanest plan with ``chosen`` offloaded fits the stage's budget (exact peak)."""
    return peak_activation_bytes(problem, lean_with_offload(problem, chosen, lean)) <= problem.activation_budget_bytes


def lean_with_offload(problem: StageProblem, chosen: frozenset[str], lean: frozenset[str]) -> Assignment:
    """The leanest plan with ``chosen`` offloaded: Megatron-full's recomputed set ``lean`` less
    ``chosen``, on demand; what the first-backpropagated group reads prefetched in the slot."""
    return Assignment(lean - chosen, {}, chosen, slot_prefetch(problem, chosen))


def exact_left(problem: StageProblem, rest: StageProblem, chosen: frozenset[str], lean: frozenset[str]) -> int | None:
    """The budget ``rest`` (the recompute problem of what ``chosen`` leaves on the device) may
    use: the stage's less what offloading adds to the leanest plan's exact peak; None where that
    joined plan does not fit the stage's budget."""
    joined = peak_activation_bytes(problem, lean_with_offload(problem, chosen, lean))
    if joined > problem.activation_budget_bytes:
        return None
    alone = peak_activation_bytes(rest, Assignment(lean - chosen))
    return problem.activation_budget_bytes - max(0, joined - alone)
