"""The event model behind benchmarks/overlap_cpu.py's ceilings: orderings and the closed form."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from overlap_model import Stage, best_transfer_ms, simulate


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("transfer", [0.0, 10.0, 30.0])
def test_variants_are_ordered(schedule, transfer):
    stages = [Stage(15, 14, 15), Stage(16, 17)]
    out = simulate(stages, transfer, 8, schedule=schedule)
    assert out["none"] <= out["lynx"] <= out["on-demand"]


def test_no_recompute_means_no_difference():
    out = simulate([Stage(10, 20), Stage(10, 20)], 12.0, 8)
    assert out["none"] == out["lynx"] == out["on-demand"]


def test_steady_state_matches_closed_form():
    # At RT = S0 + 2R Lynx's period is (RT + S0) / 2 and on-demand's (RT + S0 + R) / 2: with many
    # microbatches the ratio tends to 2 (S0 + R) / (2 S0 + 3 R).
    stages = [Stage(10, 10, 10), Stage(10, 10)]
    x = best_transfer_ms(stages)
    assert x == pytest.approx(10.0)  # (S0 + 2R - S1) / 2
    m = 400
    out = simulate(stages, x, m)
    s0, r = 20.0, 10.0
    assert out["lynx/on-demand"] == pytest.approx(2 * (s0 + r) / (2 * s0 + 3 * r), rel=0.01)


def test_tail_is_added_to_every_variant():
    stages = [Stage(15, 14, 15), Stage(16, 17)]
    a, b = simulate(stages, 20.0, 8), simulate(stages, 20.0, 8, tail_ms=25.0)
    for v in ("none", "on-demand", "lynx"):
        assert b[v] == pytest.approx(a[v] + 25.0)
