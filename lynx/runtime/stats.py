"""Measured statistics of a training step, per stage, and how to print them beside a plan.

Example::

    >>> s = StepStats(rank=0, stage=0, dp_rank=0, step_s=1.0)
    >>> s.exposed_recompute_s
    0.0
    >>> print(format_stats([s]).splitlines()[0].split()[:3])
    ['stage', 'dp', 'step']
    >>> c = StepStats(rank=0, stage=0, dp_rank=0, peak_saved_bytes_by_chunk={0: 2**20, 2: 2**21})
    >>> format_stats([c]).splitlines()[1].split()[-2:]
    ['c0:1.00', 'c2:2.00']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StepStats", "format_stats"]


@dataclass
class StepStats:
    """What one rank measured in one step (seconds and bytes)."""

    rank: int
    stage: int
    dp_rank: int
    step_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0                # backward compute incl. on-demand recompute
    wait_act_s: float = 0.0                # blocked on activation receives
    wait_grad_s: float = 0.0               # blocked on gradient receives
    wait_sync_s: float = 0.0               # blocked on data-parallel / tied-weight collectives
    recompute_hidden_s: float = 0.0        # window recompute finished before the awaited message arrived
    recompute_window_exposed_s: float = 0.0  # window recompute after it had arrived
    recompute_on_demand_s: float = 0.0     # recompute from the unpack hook, on the critical path
    recompute_on_demand_dp_s: float = 0.0  # part of it run while data-parallel collectives were in flight
    recompute_tp_hidden_s: float = 0.0     # TP-window recompute while its all-reduce was in flight
    recompute_tp_exposed_s: float = 0.0    # TP-window recompute its all-reduce did not cover
    tp_rank: int = 0
    offloaded_bytes: int = 0               # saved values copied to host memory (all microbatches)
    offload_prefetch_s: float = 0.0        # issuing window prefetches from the host (CPU: the copies)
    peak_saved_bytes: int = 0              # saved tensors owned by the stage's nodes (what plans predict)
    peak_held_bytes: int = 0               # + received boundary values and recompute inputs held
    peak_saved_bytes_by_chunk: dict[int, int] = field(default_factory=dict)   # several chunks (interleaved)
    cuda_max_memory_allocated: int | None = None
    losses: list[float] = field(default_factory=list)
    # (what, microbatch, start, end) in perf_counter seconds, with RuntimeConfig(trace=True)
    events: list[tuple[str, int, float, float]] = field(default_factory=list)

    @property
    def wait_s(self) -> float:
        return self.wait_act_s + self.wait_grad_s + self.wait_sync_s

    @property
    def exposed_recompute_s(self) -> float:
        return self.recompute_window_exposed_s + self.recompute_on_demand_s + self.recompute_tp_exposed_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["wait_s"], d["exposed_recompute_s"] = self.wait_s, self.exposed_recompute_s
        return d


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def format_stats(stats: StepStats | Sequence[StepStats], plan: Any = None) -> str:
    """A table of ``stats`` (one row per rank: every rank's, or this rank's ``pipe.last_stats``),
    with the plan's predictions when given: the schedule first, then per rank its measured
    figures (and each model chunk's peak when a rank runs several)."""
    if isinstance(stats, StepStats):
        stats = [stats]
    tp = (plan is not None and int(plan.config.get("tp", 1) or 1) > 1) or any(
        s.tp_rank or s.recompute_tp_hidden_s or s.recompute_tp_exposed_s for s in stats)
    head = (f"{'stage':>5} {'dp':>3}" + (f" {'tp':>3}" if tp else "") + f" {'step s':>8} {'wait s':>8} "
            f"{'hidden s':>9}" + (f" {'tp hidden':>9} {'tp exposed':>10}" if tp else "")
            + f" {'exposed s':>10} {'peak MiB':>9}")
    chunked = any(s.peak_saved_bytes_by_chunk for s in stats)
    if plan is not None:
        head += (f" | {'pred step s':>11} {'pred exposed':>12} {'pred hidden':>11} {'pred act MiB':>12} "
                 f"{'budget MiB':>10}")
    if chunked:
        head += f" {'per chunk MiB':>22}"
    rows = [head]
    if plan is not None:
        schedule = plan.config.get("schedule", "1f1b")
        chunks = f", {plan.config.get('virtual_stages')} chunks per rank" if schedule == "interleaved1f1b" else ""
        rows.insert(0, f"schedule {schedule}{chunks}, pp {plan.config.get('pp')}, dp {plan.config.get('dp', 1)}"
                       + (f", tp {plan.config.get('tp')}" if int(plan.config.get("tp", 1) or 1) > 1 else "")
                       + f", {plan.config.get('microbatches')} microbatches")
    for s in sorted(stats, key=lambda x: (x.stage, x.dp_rank, x.tp_rank)):
        row = (f"{s.stage:>5} {s.dp_rank:>3}" + (f" {s.tp_rank:>3}" if tp else "")
               + f" {s.step_s:>8.3f} {s.wait_s:>8.3f} {s.recompute_hidden_s:>9.3f}"
               + (f" {s.recompute_tp_hidden_s:>9.3f} {s.recompute_tp_exposed_s:>10.3f}" if tp else "")
               + f" {s.exposed_recompute_s:>10.3f} {_mib(s.peak_saved_bytes):>9}")
        if plan is not None:
            sp = plan.stage(s.stage)
            row += (f" | {plan.predicted.step_time_s:>11.3f} {sp.exposed_recompute_s:>12.3f} "
                    f"{sp.hidden_recompute_s:>11.3f} {_mib(sp.activation_bytes):>12} {_mib(sp.budget_bytes):>10}")
        if chunked:   # last, as in the header
            row += " " + f"{' '.join(f'c{c}:{_mib(b)}' for c, b in sorted(s.peak_saved_bytes_by_chunk.items())):>22}"
        rows.append(row)
    return "\n".join(rows)
