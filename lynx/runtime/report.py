"""A finished run beside its plan: measured vs predicted step time and peak activation bytes.

:func:`run_summary` takes every rank's :class:`~lynx.runtime.stats.StepStats` of every step
and the :class:`lynx.Plan` the run used. Step time is the median over the steps after the
first (warm-up: allocator, first collectives) of the slowest rank's step — the pipeline's
step; peak activation bytes are the maximum over steps and replicas of what the stage's nodes
had saved for backward (what plans predict; :attr:`StepStats.peak_saved_bytes`).
:func:`format_summary` prints both beside the plan's predictions with their ratios and the
bars they are held to: step time within a factor 1.25 either way, 0.8–1.25× (:data:`STEP_TIME_TOLERANCE`,
:func:`step_time_within`), peak activation
bytes within 5% of the prediction (:data:`MEMORY_TOLERANCE`) and never above the budget.

A measured hardware file (``lynx calibrate``, ``--hardware auto``) times each figure in CPU
time, so a prediction made with it is for the machine as calibrated: a core per rank that
nothing else takes, at the speed the cores had then. :class:`RunLoad` says what the machine
did instead: the load when it was calibrated and during the run — the CPU other processes
took while it ran, measured from the host's CPU counters (:func:`host_busy_s`) where the
system has them, else the 1-minute load average — and how much CPU time the run's busiest
rank needed per step beside what the plan counts for it. Where other jobs took more than
``LOAD_MARGIN_PER_CPU`` per cpu (or differ from the calibration's by that much), the summary
says the prediction is for the calibrated state, and the fastest step — the least disturbed —
is the one to compare with it; where the run's own CPU time per step is off the prediction by
more than the step-time tolerance while the machine was otherwise quiet, the cores themselves
ran at another speed than when calibrated (on a virtual machine: other tenants of the host's
cores and memory, which no load figure inside it shows), and the summary says so, with the
prediction scaled to the speed the run had beside the one made.

Example::

    >>> from lynx.runtime.stats import StepStats
    >>> steps = [[StepStats(rank=0, stage=0, dp_rank=0, step_s=t, peak_saved_bytes=100)] for t in (3.0, 1.0, 1.2)]
    >>> summary = run_summary(steps, plan=None)
    >>> round(summary.step_s, 3), summary.peak_saved_bytes
    (1.1, {0: 100})
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lynx.runtime.stats import StepStats

__all__ = ["RunLoad", "RunSummary", "run_summary", "format_summary", "host_busy_s", "step_time_within",
           "STEP_TIME_TOLERANCE",
           "MEMORY_TOLERANCE"]

STEP_TIME_TOLERANCE = 0.25   # measured step time within a factor 1.25 of the predicted one (0.8–1.25×)
MEMORY_TOLERANCE = 0.05      # measured peak activation bytes within 5% of the predicted ones


@dataclass
class RunLoad:
    """The machine's load while a run's prediction was made and while it ran (rank 0's host).

    ``start`` / ``end``: the 1-minute load average before the run compiled and after its last
    step; ``ranks_here``: the run's processes on this host (they count in ``end``);
    ``calibrated``: the load the hardware file was measured at (None: a preset, no measurement);
    ``others_cpus``: the cpus other processes kept busy while the run trained, measured (the
    host's busy CPU time less the run's own over the wall time; None where not measured);
    ``cpu_ratio``: the busiest rank's CPU time per step over what the plan counts for it.
    """

    start: float
    end: float
    ranks_here: int
    cpus: int
    calibrated: float | None = None
    calibrated_on: str = ""
    others_cpus: float | None = None
    cpu_ratio: float | None = None

    @property
    def others_run(self) -> float:
        """The cpus other processes took while the run ran: measured where the host counts its
        CPU time, else from the lagging load average (the larger of before and after less the
        run's own ranks)."""
        if self.others_cpus is not None:
            return max(self.others_cpus, 0.0)
        return max(self.start, self.end - self.ranks_here, 0.0)

    @property
    def speed_differs(self) -> bool:
        """The run's own CPU time per step is off the prediction by more than the step-time
        tolerance with the machine otherwise within the margin: the cores ran at another speed."""
        return (self.cpu_ratio is not None and not step_time_within(self.cpu_ratio)
                and self.others_run <= self.margin)

    @property
    def load_margin(self) -> float:
        """How far two load averages may differ and still be "the same load"."""
        from lynx.planner.hardware_cache import LOAD_MARGIN_PER_CPU

        return LOAD_MARGIN_PER_CPU * self.cpus

    @property
    def margin(self) -> float:
        """The most the other jobs may take and still leave the run the machine it was planned
        for: by load average, ``LOAD_MARGIN_PER_CPU`` per cpu; measured in cpus, what leaves each
        of the run's ranks at least 1 − ``STEP_TIME_TOLERANCE`` of the core share it would have
        alone (a core each, or cpus / ranks where they outnumber the cpus)."""
        if self.others_cpus is None:
            return self.load_margin
        return self.cpus - (1.0 - STEP_TIME_TOLERANCE) * min(self.cpus, max(self.ranks_here, 1))

    @property
    def differs(self) -> bool:
        """Other load during the run beyond the margin, or beyond it from the calibration's."""
        if self.others_run > self.margin:
            return True
        return self.calibrated is not None and abs(self.others_run - self.calibrated) > self.load_margin


@dataclass
class RunSummary:
    step_s: float                                   # measured pipeline step (median after warm-up)
    predicted_step_s: float | None
    peak_saved_bytes: dict[int, int]                # stage -> measured peak activation bytes
    timed_steps: int = 0                            # steps the step-time median is over (the first left out)
    fastest_step_s: float = 0.0                     # the fastest of them (the least disturbed by other load)
    predicted_activation_bytes: dict[int, int] = field(default_factory=dict)
    budget_bytes: int | None = None
    exposed_s: float = 0.0                          # per step, summed over stages (median replica)
    hidden_s: float = 0.0
    compute_s: dict[int, float] = field(default_factory=dict)    # stage -> forward + backward + recompute
    predicted_compute_s: dict[int, float] = field(default_factory=dict)
    # stage -> the TP all-reduces its graphs wait for, as the plan prices them (in predicted_compute_s:
    # a TP stage's measured forward and backward include those waits)
    predicted_tp_s: dict[int, float] = field(default_factory=dict)
    sync_s: dict[int, float] = field(default_factory=dict)       # stage -> optimizer step and its collectives
    activation_budget_bytes: dict[int, int] = field(default_factory=dict)  # stage -> budget less static memory
    load: RunLoad | None = None

    @property
    def step_ratio(self) -> float | None:
        return self.step_s / self.predicted_step_s if self.predicted_step_s else None

    def memory_ratio(self, stage: int) -> float | None:
        planned = self.predicted_activation_bytes.get(stage)
        return self.peak_saved_bytes[stage] / planned if planned else None


def host_busy_s() -> float | None:
    """The host's CPU time spent busy so far, all cpus together (seconds, from ``/proc/stat``:
    user, nice, system, irq, softirq and steal); None where the system does not count it.

    Example::

        >>> busy = host_busy_s()
        >>> busy is None or busy > 0
        True
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_summary(steps: Sequence[Sequence[StepStats]], plan: Any, load: RunLoad | None = None) -> RunSummary:
    """``steps[i]`` holds every rank's stats of step ``i``; ``load``: the machine's, if known."""
    timed = steps[1:] if len(steps) > 1 else steps
    pipeline_steps = [max(s.step_s for s in ranks) for ranks in timed]
    step_s = statistics.median(pipeline_steps)
    peaks: dict[int, int] = {}
    for ranks in steps:
        for s in ranks:
            peaks[s.stage] = max(peaks.get(s.stage, 0), s.peak_saved_bytes)
    # per device as the plan counts it: averaged over the replicas and the TP ranks of a stage
    dp = max(1, len({(s.dp_rank, s.tp_rank) for s in steps[0]}))
    exposed = statistics.median(sum(s.exposed_recompute_s for s in ranks) / dp for ranks in timed)
    hidden = statistics.median(sum(s.recompute_hidden_s + s.recompute_tp_hidden_s for s in ranks) / dp
                               for ranks in timed)
    summary = RunSummary(step_s=step_s, predicted_step_s=None, peak_saved_bytes=peaks, exposed_s=exposed,
                         hidden_s=hidden, timed_steps=len(timed), fastest_step_s=min(pipeline_steps), load=load)
    for stage in peaks:
        summary.compute_s[stage] = statistics.median(
            max(s.forward_s + s.backward_s + s.recompute_hidden_s + s.recompute_window_exposed_s
                for s in ranks if s.stage == stage) for ranks in timed)
        summary.sync_s[stage] = statistics.median(max(s.wait_sync_s for s in ranks if s.stage == stage)
                                                  for ranks in timed)
    if plan is not None:
        for device, kind, begin, end in plan.timeline:
            if kind in ("compute", "recompute"):
                summary.predicted_compute_s[device] = summary.predicted_compute_s.get(device, 0.0) + end - begin
        for device, kind, begin, end, label in getattr(plan, "timeline_detail", ()):
            if kind == "comm" and label == "tp":   # lynx.viz.timeline_detail: a TP collective waited for
                summary.predicted_tp_s[device] = summary.predicted_tp_s.get(device, 0.0) + end - begin
                summary.predicted_compute_s[device] = summary.predicted_compute_s.get(device, 0.0) + end - begin
        summary.predicted_step_s = plan.predicted.step_time_s
        summary.predicted_activation_bytes = {sp.index: sp.activation_bytes for sp in plan.stages}
        summary.budget_bytes = plan.stages[0].budget_bytes if plan.stages else None
        summary.activation_budget_bytes = {sp.index: sp.budget_bytes - sp.static_bytes for sp in plan.stages}
    return summary


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def step_time_within(ratio: float) -> bool:
    """Whether measured / predicted step time meets the bar: within a factor
    ``1 + STEP_TIME_TOLERANCE`` either way (0.8–1.25×: slower and faster count alike).

    >>> step_time_within(0.8), step_time_within(0.75), step_time_within(1.25)
    (True, False, True)
    """
    return 1.0 / (1.0 + STEP_TIME_TOLERANCE) - 1e-9 <= ratio <= 1.0 + STEP_TIME_TOLERANCE + 1e-9


def _step_bar(ratio: float) -> str:
    low, high = 1.0 / (1.0 + STEP_TIME_TOLERANCE), 1.0 + STEP_TIME_TOLERANCE
    return ("" if step_time_within(ratio) else "NOT ") + f"within {low:.1f}–{high:.2f}×"


def _bar(ratio: float, tolerance: float) -> str:
    return f"within {tolerance:.0%}" if abs(ratio - 1.0) <= tolerance else f"NOT within {tolerance:.0%}"


def _load_lines(summary: RunSummary) -> list[str]:
    load = summary.load
    assert load is not None
    on = f" ({load.calibrated_on})" if load.calibrated_on else ""
    when = (f"{load.calibrated:.2f} when this machine was calibrated{on}" if load.calibrated is not None
            else "no calibration (a preset's figures)")
    lines = [f"load (1-minute average, {load.cpus} cpus): {when}; {load.start:.2f} before this run, {load.end:.2f} "
             f"after it (its {load.ranks_here} ranks count up to {load.ranks_here} of that)"
             + (f"; other processes took {load.others_run:.2f} cpus while it trained (the host's CPU time less "
                f"the run's own)" if load.others_cpus is not None else "")]
    if load.differs and summary.predicted_step_s:
        fastest = summary.fastest_step_s / summary.predicted_step_s
        ratio = summary.step_ratio
        assert ratio is not None   # there is a prediction
        if load.others_run > load.margin:
            slower = "so its steps ran slower" if ratio > 1 else "which can slow its steps"
            what = f"other jobs took about {load.others_run:.1f} cpus during this run, {slower}"
        else:
            what = (f"the figures were measured at load {load.calibrated:.2f} (their spread says how steadily), other "
                    f"jobs took {load.others_run:.1f} cpus during this run")
        margin = (f"{load.margin:.1f} cpus (what leaves each rank {1 - STEP_TIME_TOLERANCE:.0%} of its core share)"
                  if load.others_cpus is not None and load.others_run > load.margin
                  else f"{load.load_margin:.1f} ({load.load_margin / load.cpus:g} per cpu)")
        lines.append(
            f"the prediction is for the calibrated state, a core per rank with nothing else running (calibration "
            f"times CPU time), and this run's load differs from it by more than the margin of {margin}: {what}; "
            f"the fastest step, the least "
            f"disturbed, is {fastest:.2f}× the prediction ({_step_bar(fastest)}), the median "
            f"{ratio:.2f}×")
    if load.speed_differs and summary.predicted_step_s:
        cpu_ratio = load.cpu_ratio
        assert cpu_ratio is not None   # speed_differs: the run's CPU time was read
        scaled = summary.predicted_step_s * cpu_ratio
        pace = "slower" if cpu_ratio > 1 else "faster"
        lines.append(
            f"the run's ranks needed {cpu_ratio:.2f}× the CPU time per step the prediction counts while other "
            f"jobs took {load.others_run:.1f} cpus: the cores ran {pace} than when calibrated, which CPU time "
            f"shows and no load figure does (on a virtual machine: other tenants of the host's cores and memory; or "
            f"another clock); the prediction is for the calibrated speed — at this run's it is "
            f"{scaled * 1e3:.1f} ms, measured/that {summary.step_s / scaled:.2f}; `lynx calibrate` measures the "
            f"machine as it is now")
    return lines


def format_summary(summary: RunSummary, plan: Any = None) -> str:
    """Plain-text lines: step time and, per stage, activation memory, measured vs predicted."""
    lines = []
    if plan is not None:   # what ran: the schedule and its chunks
        schedule = plan.config.get("schedule", "1f1b")
        chunks = {s.index: [c.index for c in s.chunks] for s in plan.stages if len(s.chunks) > 1}
        lines.append(f"schedule {schedule}" + (f", chunks per stage {chunks}" if chunks else "")
                     + (", weight gradients deferred (W)" if schedule == "zbh1" else ""))
    steps = (f"median of {summary.timed_steps} steps, the first (warm-up) left out; fastest "
             f"{summary.fastest_step_s * 1e3:.1f} ms" if summary.timed_steps > 1 else "one step")
    if summary.predicted_step_s:
        ratio = summary.step_ratio
        assert ratio is not None   # there is a prediction
        lines.append(f"step time: measured {summary.step_s * 1e3:.1f} ms ({steps}), predicted "
                     f"{summary.predicted_step_s * 1e3:.1f} ms: measured/predicted {ratio:.2f} "
                     f"({_step_bar(ratio)}; fastest step "
                     f"{summary.fastest_step_s / summary.predicted_step_s:.2f})")
    else:
        lines.append(f"step time: measured {summary.step_s * 1e3:.1f} ms ({steps})")
    if summary.load is not None:
        lines.extend(_load_lines(summary))
    if plan is not None:
        p = plan.predicted
        lines.append(f"recompute per step: measured exposed {summary.exposed_s * 1e3:.1f} ms, hidden "
                     f"{summary.hidden_s * 1e3:.1f} ms; predicted exposed {p.exposed_recompute_s * 1e3:.1f} ms, "
                     f"hidden {p.hidden_recompute_s * 1e3:.1f} ms")
    for stage in sorted(summary.compute_s):
        line = f"stage {stage} compute (forward, backward, recompute): measured {summary.compute_s[stage] * 1e3:.1f} ms"
        if summary.predicted_compute_s.get(stage):
            tp = summary.predicted_tp_s.get(stage)
            line += (f", predicted {summary.predicted_compute_s[stage] * 1e3:.1f} ms"
                     + (f" with {tp * 1e3:.1f} ms of TP all-reduces waited for" if tp else "")
                     + f" (measured/predicted {summary.compute_s[stage] / summary.predicted_compute_s[stage]:.2f})")
        lines.append(line + f"; optimizer step + data-parallel sync {summary.sync_s[stage] * 1e3:.1f} ms")
    for stage in sorted(summary.peak_saved_bytes):
        measured = summary.peak_saved_bytes[stage]
        line = f"stage {stage} peak activations: measured {_mib(measured)}"
        ratio = summary.memory_ratio(stage)
        if ratio is not None:
            line += (f", predicted {_mib(summary.predicted_activation_bytes[stage])}: measured/predicted "
                     f"{ratio:.3f} ({_bar(ratio, MEMORY_TOLERANCE)})")
        budget = summary.activation_budget_bytes.get(stage)
        if budget is not None:
            line += f"; {'under' if measured <= budget else 'ABOVE'} the activation budget {_mib(budget)}"
        if plan is not None:
            sp = plan.stage(stage)
            line += f" ({_mib(sp.budget_bytes)} less {_mib(sp.static_bytes)} weights+grads+optimizer)"
        lines.append(line)
    return "\n".join(lines)
