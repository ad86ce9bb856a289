"""The memory model replays a device's action list: 1F1B's closed form, chunks, deferred ``W``.

``lynx.solvers.memory_replay`` walks the list ``lynx.planner.schedule.rank_actions`` gives a
device. With one chunk and backwards in microbatch order it must give what the closed form
``others(j) · held + own(j)`` gives (the form ``tests/test_peak_prediction.py`` checks against
the runtime's meter, to the byte); with several chunks each in-flight pair holds its own
chunk's bytes; under ZB-H1 a microbatch whose ``I`` ran holds, until its ``W``, what it kept and
the values ``I`` regenerated that ``W`` reads. (The runtime's measured peak against these
predictions: ``tests/runtime/test_user_pipeline.py``.)
"""

from __future__ import annotations

import dataclasses

import pytest

from lynx.planner.schedule import Op, compute_order, max_in_flight, rank_actions
from lynx.solvers.heu.solve import solve_heu
from lynx.solvers.memory import held_bytes, peak_activation_bytes, peak_upper_bound_bytes
from lynx.solvers.memory_weights import split_backward_bytes
from lynx.solvers.problem import Assignment
from lynx.solvers.synthetic import make_uniform_problem

M = 4


def _with_actions(problem, schedule: str, stage: int, pp: int, virtual: int = 1):
    return dataclasses.replace(problem, actions=tuple(rank_actions(schedule, pp, M, virtual)[stage]))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stage", [0, 1])
def test_one_chunk_replay_is_the_closed_form(schedule, stage):
    in_flight = max_in_flight(schedule, stage=stage, stages=2, microbatches=M)
    base = make_uniform_problem(layers=2, microbatches=M, in_flight=in_flight, budget_fraction=0.6,
                                recv_grad_capacity_s=1.0, seq=256, stage=stage)
    closed = dataclasses.replace(base, backward_in_order=True)
    plans = [Assignment(frozenset()), solve_heu(closed).assignment,
             Assignment(frozenset(n.name for n in base.nodes if n.saved_bytes and not n.name.endswith("add2")))]
    assert any(a.recompute for a in plans) and (stage == 1 or any(a.window_of for a in plans))
    for a in plans:
        replayed = _with_actions(closed, schedule, stage, pp=2)
        assert peak_activation_bytes(replayed, a) == peak_activation_bytes(closed, a)
        assert peak_activation_bytes(replayed, a) <= peak_upper_bound_bytes(replayed, a)


def test_each_chunk_holds_its_own_bytes():
    """Interleaved (pp 2, 2 chunks per device), keeping everything: at every backward the device
    holds, per in-flight (chunk, microbatch), that chunk's bytes — not the device's."""
    p = make_uniform_problem(layers=3, microbatches=M, in_flight=3, seq=256)
    # chunk 0 is the first layer, chunk 2 the other two: different bytes per microbatch
    nodes = tuple(dataclasses.replace(n, chunk=0 if n.layer == 0 else 2) for n in p.nodes)
    p = _with_actions(dataclasses.replace(p, nodes=nodes), "interleaved1f1b", stage=0, pp=2, virtual=2)
    size = {c: sum(n.saved_bytes for n in nodes if n.chunk == c) for c in (0, 2)}
    assert size[0] != size[2]
    live, expected = set(), 0
    for a in compute_order("interleaved1f1b", 2, M, 2)[0]:
        if a.op is Op.FORWARD:
            live.add((a.chunk, a.microbatch))
        expected = max(expected, sum(size[c] for c, _ in live))
        if a.op is Op.BACKWARD:
            live.discard((a.chunk, a.microbatch))
    keep = Assignment(frozenset())
    assert peak_activation_bytes(p, keep) == expected
    assert expected < p.in_flight * sum(size.values())   # what charging the device's bytes said
    assert peak_activation_bytes(p, keep) <= peak_upper_bound_bytes(p, keep)


def test_weight_part_holds_what_input_part_regenerated_for_it():
    """ZB-H1, as the generated graphs do it: a dropped node whose statistics I reads and whose
    output only W reads is re-run by I for its statistics alone (the output is not brought
    back there) and by W for its output; where I re-runs a dropped consumer of it, I brings the
    output back and hands it to W, which then regenerates nothing."""
    p = make_uniform_problem(layers=1, microbatches=M, in_flight=2, seq=256)
    ln2 = next(n for n in p.nodes if n.name.endswith("ln2"))
    fc1 = next(n for n in p.nodes if n.name.endswith("fc1"))
    nodes = tuple(dataclasses.replace(n, output_bytes=n.saved_bytes // 2, output_reads=(False, True),
                                      rest_reads=(True, False)) if n is ln2 else
                  dataclasses.replace(n, output_reads=(True, False), rest_reads=(True, False)) for n in p.nodes)
    p = dataclasses.replace(p, nodes=nodes)
    alone = Assignment(frozenset({ln2.name}))
    during_i, held_until_w, during_w = split_backward_bytes(p, alone, frozenset())
    assert held_until_w == held_bytes(p, alone)   # nothing handed over
    assert during_w == held_until_w + ln2.saved_bytes // 2   # W brings the output back itself
    drop = Assignment(frozenset({ln2.name, fc1.name}))
    during_i, held_until_w, during_w = split_backward_bytes(p, drop, frozenset())
    assert held_until_w == held_bytes(p, drop) + ln2.saved_bytes // 2
    assert during_i >= held_until_w and during_w == held_until_w   # W regenerates nothing itself
    zb = [_with_actions(p, "zbh1", stage=s, pp=2) for s in range(2)]
    one_f_one_b = _with_actions(p, "1f1b", stage=1, pp=2)
    # stage 1 defers each W past the next microbatch's I: one more microbatch holds its values
    assert peak_activation_bytes(zb[1], drop) > peak_activation_bytes(one_f_one_b, drop)
    for problem in zb:
        assert peak_activation_bytes(problem, drop) <= peak_upper_bound_bytes(problem, drop)
