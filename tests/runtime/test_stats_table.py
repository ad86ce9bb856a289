"""``format_stats``: one rank's stats or every rank's, the TP columns on every TP rank's table."""

from __future__ import annotations

import types

from lynx.runtime.stats import StepStats, format_stats


def _plan(tp: int) -> types.SimpleNamespace:
    stage = types.SimpleNamespace(exposed_recompute_s=0.0, hidden_recompute_s=0.001, activation_bytes=2 << 20,
                                  budget_bytes=3 << 20)
    return types.SimpleNamespace(config={"schedule": "1f1b", "pp": 1, "dp": 1, "tp": tp, "microbatches": 2},
                                 predicted=types.SimpleNamespace(step_time_s=0.015), stage=lambda s: stage)


def test_one_ranks_stats_print_as_a_table_with_the_plans_tp_columns() -> None:
    rank0 = StepStats(rank=0, stage=0, dp_rank=0, tp_rank=0, step_s=0.126)   # pipe.last_stats on TP rank 0
    rank1 = StepStats(rank=1, stage=0, dp_rank=0, tp_rank=1, step_s=0.128)
    alone, both = format_stats(rank0, _plan(2)), format_stats([rank0, rank1], _plan(2))
    assert alone.splitlines()[1] == both.splitlines()[1]                     # the same header on every rank
    assert "tp hidden" in alone and len(alone.splitlines()) == 3 and len(both.splitlines()) == 4
    assert "tp hidden" not in format_stats(rank0, _plan(1))
