"""Checkmate vs torch's activation-checkpointing knapsack solvers on the no-overlap problem.

torch._functorch._activation_checkpointing.knapsack chooses which items to save given their
memory, their recompute runtime and a memory cap; it knows nothing about which inputs a
recomputation needs. We hand it this stage's nodes (memory = bytes kept for the microbatches
in flight, runtime = recompute time over all microbatches) and a cap that leaves room for the
largest on-demand layer, repair its answer to a valid plan, and check Checkmate is never
worse wherever that plan fits.
"""

import pytest

from lynx.solvers.baselines import make_valid
from lynx.solvers.checkmate import solve_checkmate, without_windows
from lynx.solvers.problem import Assignment, exposed_recompute_s, group_key
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.validate import validate

knapsack = pytest.importorskip("torch._functorch._activation_checkpointing.knapsack")

PEERS = {"greedy_knapsack": knapsack.greedy_knapsack, "dp_knapsack": knapsack.dp_knapsack}
try:  # ilp_knapsack needs scipy
    import scipy.optimize  # noqa: F401

    PEERS["ilp_knapsack"] = knapsack.ilp_knapsack
except ImportError:
    pass

GiB = 2**30


def _peer_plan(problem, fn):
    items = [n for n in problem.nodes if n.saved_bytes > 0]
    memory = [problem.in_flight * n.saved_bytes / GiB for n in items]
    runtime = [problem.microbatches * n.recompute_s for n in items]
    layer_bytes: dict[str, int] = {}
    for n in problem.nodes:
        layer_bytes[group_key(n)] = layer_bytes.get(group_key(n), 0) + n.saved_bytes
    cap = (problem.activation_budget_bytes - max(layer_bytes.values())) / GiB
    _, save, _ = fn(memory, runtime, cap)
    saved = {items[i].name for i in save}
    dropped = {n.name for n in problem.nodes if n.name not in saved and n.saved_bytes > 0}
    return Assignment(make_valid(problem, dropped), {})


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_checkmate_never_worse_than_knapsack(peer):
    compared = 0
    for layers, fraction, views in [(2, 0.3, False), (3, 0.4, True), (4, 0.55, False), (3, 0.7, True)]:
        p = without_windows(make_uniform_problem(layers=layers, microbatches=6, in_flight=3, budget_fraction=fraction,
                                                 views=views, hidden=512, heads=8, seq=512))
        mine = solve_checkmate(p, time_limit_s=30.0)
        validate(p, mine.assignment)
        theirs = _peer_plan(p, PEERS[peer])
        validate(p, theirs)
        if peak_activation_bytes(p, theirs) <= p.activation_budget_bytes:
            compared += 1
            assert mine.objective_s <= exposed_recompute_s(p, theirs) * (1 + 1e-4) + 1e-12
    assert compared >= 2  # the comparison actually happened
