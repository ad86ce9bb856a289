"""Zero bubble: what a split backward's on-demand recomputation costs, part by part.

The generated input-gradient graph ``I`` re-runs each dropped value it reads and hands the
weight-gradient graph ``W`` what it brought back that ``W`` reads; ``W`` re-runs whatever else
it needs — a value ``I`` re-ran for its statistics alone, or only to re-run a consumer, is re-run
again (``lynx.rewrite.emit_backward``; ``tests/test_zero_bubble_split.py`` checks the graphs).
The timeline charges each part what it re-runs (``Loads.on_demand`` for ``I``,
``Loads.on_demand_weight`` for ``W``), and the solvers' exposed time counts both.
"""

from __future__ import annotations

import dataclasses

import pytest

from lynx.planner.comm import CommModel
from lynx.planner.problems import build_pipeline, build_problems, loads_from_assignments, static_bytes
from lynx.planner.schedule import rank_actions
from lynx.planner.synthetic import synthetic_graph
from lynx.planner.timeline import Loads, PipelineCosts, run_timeline
from lynx.solvers.memory_weights import regenerated_nodes, rerun_counts
from lynx.solvers.exposed import exposed_recompute_s
from lynx.solvers.problem import Assignment
from lynx.solvers.synthetic import make_uniform_problem

M = 4


def _ln2_read_by_i_for_statistics_only():
    """One layer, of the second chunk (the first sends no gradient: its ``W`` is the whole
    backward), whose ``ln2`` saves statistics ``I`` reads and an output only ``W`` reads (as
    ``tests/solvers/test_memory_replay.py`` builds it)."""
    p = make_uniform_problem(layers=1, microbatches=M, in_flight=2, seq=256)
    p = dataclasses.replace(p, nodes=tuple(dataclasses.replace(n, chunk=1) for n in p.nodes))
    ln2 = next(n for n in p.nodes if n.name.endswith("ln2"))
    fc1 = next(n for n in p.nodes if n.name.endswith("fc1"))
    nodes = tuple(dataclasses.replace(n, output_bytes=n.saved_bytes // 2, output_reads=(False, True),
                                      rest_reads=(True, False)) if n is ln2 else
                  dataclasses.replace(n, output_reads=(True, False), rest_reads=(True, False)) for n in p.nodes)
    return dataclasses.replace(p, nodes=nodes), ln2, fc1


def _actions(problem, schedule: str):
    return dataclasses.replace(problem, actions=tuple(rank_actions(schedule, 2, M)[1]))


def test_w_reruns_what_i_reran_but_did_not_hand_over():
    """Dropped alone, ``ln2`` is re-run by ``I`` (its statistics) and again by ``W`` (its
    output): twice the seconds under ZB-H1, once under 1F1B. Dropped with ``fc1``, ``I``
    re-runs ``ln2``'s output for ``fc1`` and hands it over: once."""
    p, ln2, fc1 = _ln2_read_by_i_for_statistics_only()
    alone = Assignment(frozenset({ln2.name}))
    assert regenerated_nodes(p, alone, frozenset()) == ({ln2.name}, {ln2.name})
    assert exposed_recompute_s(_actions(p, "zbh1"), alone) == pytest.approx(2 * M * ln2.recompute_s)
    assert exposed_recompute_s(_actions(p, "1f1b"), alone) == pytest.approx(M * ln2.recompute_s)
    both = Assignment(frozenset({ln2.name, fc1.name}))
    assert regenerated_nodes(p, both, frozenset()) == ({ln2.name, fc1.name}, frozenset())
    assert exposed_recompute_s(_actions(p, "zbh1"), both) == pytest.approx(M * (ln2.recompute_s + fc1.recompute_s))
    # recomputed in a window for a microbatch: neither part re-runs it there
    assert regenerated_nodes(p, alone, frozenset({ln2.name})) == (frozenset(), frozenset())


def test_the_solvers_price_never_below_what_the_parts_rerun():
    """``rerun_counts`` (what HEU and OPT price an on-demand item at) is, for every node and
    whatever else is dropped, at least how many parts re-run it; ``ln2`` alone: twice."""
    p, ln2, _fc1 = _ln2_read_by_i_for_statistics_only()
    counts = rerun_counts(p)
    assert counts[ln2.name] == 2
    names = [n.name for n in p.nodes if n.saved_bytes > 0]
    for k in range(len(names)):
        for dropped in (names[k:], names[:k + 1], names[k::2]):
            in_i, in_w = regenerated_nodes(p, Assignment(frozenset(dropped)), frozenset())
            assert all(counts[x] >= (x in in_i) + (x in in_w) for x in in_i | in_w), dropped


def test_the_timeline_charges_w_its_own_reruns():
    """``Loads.on_demand_weight`` runs inside ``W``, before the block's weight part: each ``W``
    takes that much longer, the device is busy (and exposed) that much more."""
    plain = PipelineCosts.uniform(pp=2, microbatches=M, forward_s=1.0, backward_s=2.0, schedule="zbh1")
    pipe = dataclasses.replace(plain, costs=tuple(dataclasses.replace(c, backward_weight_s=1.0) for c in plain.costs))
    base = run_timeline(pipe, Loads(on_demand={(1, j, 1): 0.5 for j in range(M)}))
    more = run_timeline(pipe, Loads(on_demand={(1, j, 1): 0.5 for j in range(M)},
                                    on_demand_weight={(1, j, 1): 0.25 for j in range(M)}))

    def lengths(t, kind):
        return [a.end - a.start for a in t.actions[1] if a.kind == kind]

    assert lengths(more, "W") == pytest.approx([w + 0.25 for w in lengths(base, "W")])
    assert lengths(more, "I") == pytest.approx(lengths(base, "I"))
    assert more.busy_s[1] == pytest.approx(base.busy_s[1] + M * 0.25)
    assert more.exposed_recompute_s[1] == pytest.approx(base.exposed_recompute_s[1] + M * 0.25)
    assert more.busy_s[0] == pytest.approx(base.busy_s[0])


def test_the_loads_add_up_to_the_exposed_time():
    """Under ZB-H1 the seconds the loads put in ``I`` and ``W`` are the solvers' exposed
    seconds, stage by stage; the first stage's ``I`` (it sends no gradient) re-runs nothing."""
    g = synthetic_graph(layers=4)
    pipe = build_pipeline(g, pp=2, microbatches=M, schedule="zbh1", comm=CommModel.free())
    problems = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40,
                              static=static_bytes(g, pipe, optimizer="adamw"))
    assignments = [Assignment(frozenset(n.name for n in p.nodes if n.saved_bytes > 0)) for p in problems]
    loads = loads_from_assignments(g, pipe, problems, assignments)
    for s, (problem, assignment) in enumerate(zip(problems, assignments)):
        chunks = {c.index for c in pipe.chunks if c.device == s}
        seconds = sum(v for (c, _j, _b), v in (*loads.on_demand.items(), *loads.on_demand_weight.items())
                      if c in chunks)
        assert seconds == pytest.approx(exposed_recompute_s(problem, assignment))
        assert seconds > 0
        counts = rerun_counts(problem)
        in_i, in_w = regenerated_nodes(problem, assignment, frozenset())
        assert all(counts[x] >= (x in in_i) + (x in in_w) for x in in_i | in_w)
    assert not any(v for (c, _j, _b), v in loads.on_demand.items() if c == 0)
