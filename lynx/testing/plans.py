"""Hand-made plans: drop sets and windows chosen by a test, as a plan ``Pipeline`` runs.

:func:`captured_with_plan` is what a spawned rank uses instead of :func:`lynx.compile`: the
model captured and paired with a plan the parent process made (and ``lynx.compile`` checked)
for the same model, without profiling it again in every rank (seconds per rank on a small
machine); :class:`lynx.runtime.Pipeline` still compares the plans of all ranks.

:func:`with_stages` returns a copy of a :class:`lynx.Compiled` whose plan splits the graph as
``stage_nodes`` (default: as the compiled plan does) and drops and recomputes what each
stage's :class:`~lynx.plan.StageSchedule` says — per microbatch, which nodes each window
brings back — under ``schedule`` (default: the compiled one). Its predictions are zero (no
simulator made them); its fingerprint is that of the compiled model under the new settings.

Example::

    >>> import lynx
    >>> from lynx.plan import StageSchedule
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> compiled = lynx.compile(model, inputs, pp=2, microbatches=2, solver="none", hardware="cpu-local")
    >>> node = compiled.plan.stage(0).decisions[3].node
    >>> drops = [StageSchedule(frozenset({node}), {0: [("s0.recv_grad.mb0", [node])]}), StageSchedule(frozenset())]
    >>> hand = with_stages(compiled, drops, schedule="gpipe")
    >>> hand.plan.stage_schedule(0).prefetch[0], hand.plan.stage_schedule(0).prefetch[1]
    ([('s0.recv_grad.mb0', ['add'])], [])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from lynx.errors import LynxPlanError
from lynx.plan import Decision, Plan, Predicted, StagePlan, StageSchedule, fingerprint_of

__all__ = ["with_stages", "captured_with_plan"]


def captured_with_plan(model: Any, inputs: Any, plan: Plan, config: Any, *, sharding: Any = None,
                       layer_of: dict[str, int] | None = None, captured: Any = None) -> Any:
    """A :class:`lynx.Compiled` of ``model`` holding ``plan`` (made for it by ``config``), from a
    capture alone (see module docstring). For tp > 1 pass the parent's ``compiled.sharding``
    and each node's layer (``layer_of``: where the plan's TP windows run). ``captured``: an
    earlier capture of the same model to reuse (its stage splits and joint traces with it)."""
    from types import SimpleNamespace

    from lynx.compiler import Compiled
    from lynx.frontend.analyze import Analysis
    from lynx.frontend.capture import capture
    from lynx.runtime.loss import find_loss, output_structure

    captured = captured if captured is not None else capture(model, inputs)
    # no profile or graph: a stand-in with what stages and the runtime read of an Analysis
    analysis = cast(Analysis, SimpleNamespace(captured=captured, graph=None, layer_of=dict(layer_of or {})))
    return Compiled(plan=plan, config=config, analysis=analysis,
                    loss=find_loss(output_structure(captured.gm)), sharding=sharding)


def with_stages(compiled: Any, schedules: Sequence[StageSchedule], *,
                stage_nodes: Sequence[Sequence[str]] | None = None, schedule: str | None = None) -> Any:
    """``compiled`` with a plan made of ``schedules`` (see module docstring)."""
    from lynx.rewrite.build import stage_node_lists

    plan = compiled.plan
    same_split = stage_nodes is None
    nodes = stage_node_lists(plan, compiled.analysis.graph) if stage_nodes is None else [list(n) for n in stage_nodes]
    if len(schedules) != len(nodes):
        raise LynxPlanError(f"{len(schedules)} stage schedules for {len(nodes)} stages")
    m = plan.microbatches
    stages = []
    for s, (names, sched) in enumerate(zip(nodes, schedules)):
        unknown = sorted(sched.dropped - set(names))
        if unknown:
            raise LynxPlanError(f"stage {s} drops {unknown[:3]}, which are not its nodes")
        windows: dict[str, dict[int, str]] = {}
        for j, entries in sched.prefetch.items():
            for window, members in entries:
                wid = str(window)   # the plan's JSON form
                for n in members:
                    if n not in sched.dropped:
                        raise LynxPlanError(f"stage {s}: window {wid} recomputes {n}, which is not dropped")
                    if windows.setdefault(n, {}).setdefault(int(j), wid) != wid:
                        raise LynxPlanError(f"stage {s}: {n} is in two windows for microbatch {j}")
        decisions = [Decision(node=n, action="keep") if n not in sched.dropped else
                     _recompute(n, windows.get(n, {}), m) for n in names]
        old = plan.stage(s)
        stages.append(StagePlan(index=s, layers=old.layers if same_split else [],
                                blocks=old.blocks if same_split else [], budget_bytes=old.budget_bytes,
                                peak_memory_bytes=0, decisions=decisions))
    config = compiled.config.replace(schedule=schedule) if schedule else compiled.config
    fields = config.fingerprint_fields()
    hand = Plan(fingerprint=fingerprint_of(plan.graph_fingerprint, fields), graph_fingerprint=plan.graph_fingerprint,
                config={**plan.config, **fields}, solver="hand", status="HAND", search_time_s=0.0, stages=stages,
                windows=[], predicted=Predicted(step_time_s=0.0, peak_memory_bytes=[0] * len(stages)))
    return dataclasses.replace(compiled, plan=hand, config=config)


def _recompute(node: str, windows: dict[int, str], microbatches: int) -> Decision:
    ids = set(windows.values())
    if len(windows) == microbatches and len(ids) == 1:
        return Decision(node=node, action="recompute", window=ids.pop())
    return Decision(node=node, action="recompute", windows=windows or None)
