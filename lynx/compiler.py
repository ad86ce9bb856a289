"""`lynx.compile`: analyse a model, plan recomputation per pipeline stage, return a `Compiled`.

The analysis is :func:`lynx.analyze` (capture, profile, graph); the plan comes from the planning
loop (:func:`lynx.planner.loop.plan_graph`) or from a saved plan checked against this model;
:meth:`Compiled.stage` builds the executable module of one pipeline stage.

Example::

    >>> import lynx
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> compiled = lynx.compile(model, inputs, pp=2, microbatches=2, memory_budget="1GiB",
    ...                         hardware="cpu-local", solver="none")
    >>> len(compiled.plan.stages), compiled.plan.predicted.fits_budget
    (2, True)
    >>> list(compiled.phases)  # wall seconds per phase (lynx.phases)
    ['capture', 'profile', 'graph', 'setup', 'simulate', 'plan', 'search']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from lynx.config import CompileConfig
from lynx.errors import LynxConfigError
from lynx.phases import Phases
from lynx.plan import Plan, check_fingerprint
from lynx.planner.loop import plan_graph_outcome
from lynx.planner.fingerprint import graph_fingerprint
from lynx.planner.simulator import SimResult

if TYPE_CHECKING:  # torch-side types: importing lynx.compiler stays light
    from lynx.frontend.analyze import Analysis
    from lynx.rewrite.stage import StageModule
    from lynx.runtime.loss import LossSpec

__all__ = ["compile", "compile_analysis", "Compiled", "resolve_config"]


@dataclass
class Compiled:
    """The result of :func:`compile`: the plan, the settings and the analysis it was made from."""

    plan: Plan
    config: CompileConfig
    analysis: Analysis
    # wall seconds per phase: capture, profile, graph, setup, plan, search, simulate (lynx.phases)
    phases: Phases = field(default_factory=Phases)
    loss: Optional[LossSpec] = None    # which part of the output is the loss
    # tp > 1: which linear layers are sharded (lynx.frontend.sharding.ShardingPlan)
    sharding: Any = None

    def stage(self, index: int, tp_mesh: Any = None) -> StageModule:
        """Executable ``nn.Module`` for pipeline stage ``index`` with the plan applied; with
        ``tp_mesh`` (this rank's 1-D tensor-parallel ``DeviceMesh``, tp > 1) the rank's shard of it."""
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.config.pp:
            raise LynxConfigError(
                f"stage {index!r} is out of range: this compilation has stages 0..{self.config.pp - 1}"
            )
        gm = self.analysis.captured.gm
        meta = [name for name, t in (*gm.named_parameters(), *gm.named_buffers()) if t.is_meta]
        if meta:
            raise LynxConfigError(
                f"cannot build stage {index}: the model was compiled on the meta device ({len(meta)} "
                f"parameter(s)/buffer(s) have no data, e.g. {meta[0]!r}), so the stage could not run. "
                f"A meta model can be planned but not executed: build the model on cpu or cuda (or load "
                f"its weights) and compile it again, reusing the saved plan with plan=."
            )
        from lynx.rewrite import build_stage_module

        return build_stage_module(self, index, tp_mesh=tp_mesh)

    def simulate(self) -> SimResult:
        """Replay the plan on this model's timeline."""
        from lynx.planner.simulator import simulate

        return simulate(self.plan, self.analysis.graph)


def resolve_config(config: Optional[CompileConfig], settings: dict[str, Any]) -> CompileConfig:
    """One config from an optional ``CompileConfig`` and keyword overrides."""
    if config is None:
        return CompileConfig(**settings)
    if not isinstance(config, CompileConfig):
        raise LynxConfigError(f"config must be a lynx.CompileConfig, got {type(config).__name__}")
    return config.replace(**settings) if settings else config


def compile(
    model: Any,
    example_inputs: Any,
    config: Optional[CompileConfig] = None,
    *,
    loss_fn: Optional[Callable[..., Any]] = None,
    **settings: Any,
) -> Compiled:
    """Analyse ``model`` on one microbatch of ``example_inputs`` and plan it (see module doc).

    Settings are those of :class:`lynx.CompileConfig`, as one object, keywords, or both
    (keywords win). With ``plan=`` the saved plan is checked against this model and config
    (:class:`lynx.LynxFingerprintError` when it was made for others, naming what differs), its
    records and predictions re-checked by replaying its decisions
    (:func:`lynx.planner.plan_check.recheck_plan`: :class:`lynx.LynxPlanError` naming the stage and
    field that disagree, or the stage over its budget), and then used as it is.
    ``example_inputs`` is a tuple (positional) or a dict (keyword inputs). ``compiled.loss``
    says which part of the model's output is the training loss (``loss_fn(output, *targets)``
    when given; see :mod:`lynx.runtime.loss`); an output without one is accepted for planning,
    and :class:`lynx.runtime.Pipeline` refuses to train it with that message.
    """
    config = resolve_config(config, settings)
    from lynx.frontend.analyze import analyze
    from lynx.runtime.loss import LossSpec

    LossSpec(None, "").with_loss_fn(loss_fn)  # a loss_fn that is not callable fails here, before the analysis
    analysis = analyze(model, example_inputs, target=config.target, hardware=config.hardware_spec())
    return _plan_analysis(analysis, config, loss_fn)


def compile_analysis(
    analysis: Analysis,
    config: Optional[CompileConfig] = None,
    *,
    loss_fn: Optional[Callable[..., Any]] = None,
    **settings: Any,
) -> Compiled:
    """:func:`compile` from an analysis already made (:func:`lynx.analyze`, for the same target
    and hardware): several layouts of one model (``pp``, ``tp``) plan from one capture and
    profile. ``analysis`` is left as it was: each layout plans on a copy of its graph (sharding
    and planning mark the graph's nodes and blocks)."""
    import copy
    import dataclasses

    config = resolve_config(config, settings)
    if analysis.target != config.target or analysis.hardware.name != config.hardware_spec().name:
        raise LynxConfigError(
            f"the analysis was made for target {analysis.target!r} on {analysis.hardware.name!r}, the config asks "
            f"for {config.target!r} on {config.hardware_spec().name!r}: analyse the model again for them")
    return _plan_analysis(dataclasses.replace(analysis, graph=copy.deepcopy(analysis.graph)), config, loss_fn)


def _plan_analysis(analysis: Analysis, config: CompileConfig, loss_fn: Optional[Callable[..., Any]]) -> Compiled:
    """The loss, the sharding (tp > 1) and the plan (saved and re-checked, or searched) of ``analysis``."""
    from lynx.frontend.tp_profile import apply_sharding
    from lynx.runtime.loss import LossSpec, find_loss, output_structure

    loss = LossSpec(None, "").with_loss_fn(loss_fn)
    if loss_fn is None:
        structure = output_structure(analysis.captured.gm)
        loss = (
            find_loss(structure)
            if structure is not None
            else LossSpec(
                "scalar", "the model's output shapes were not recorded (symbolic_trace capture): it must be the loss"
            )
        )
    phases = Phases(analysis.phases)
    config, sharding = apply_sharding(analysis, config)
    if config.plan is not None:
        plan = config.plan if isinstance(config.plan, Plan) else Plan.load(config.plan)
        check_fingerprint(plan, graph_fingerprint(analysis.graph), config.fingerprint_fields())
        from lynx.planner.plan_check import recheck_plan

        with phases.timed("simulate"):
            recheck_plan(plan, analysis.graph)   # its decisions and predictions, not trusted as stored
        return Compiled(plan=plan, config=config, analysis=analysis, phases=phases, loss=loss, sharding=sharding)
    outcome = plan_graph_outcome(analysis.graph, config)
    assert outcome.plan is not None  # assembled (plan_graph_outcome's default)
    return Compiled(
        plan=outcome.plan, config=config, analysis=analysis, phases=phases.update_from(outcome.phases), loss=loss,
        sharding=sharding)
