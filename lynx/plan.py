"""`Plan`: the decisions Lynx made for one model and config — JSON on disk, versioned, fingerprinted.

A plan records, per pipeline stage, which nodes keep their saved tensors and which are
recomputed (in which window, or on demand), the windows it was made with, and the
simulator's prediction. :meth:`Plan.stage_schedule` is the only view the runtime reads.

Example::

    >>> from lynx.plan import Plan, StagePlan, Decision, Predicted
    >>> plan = Plan(fingerprint="f", graph_fingerprint="g", config={"microbatches": 2},
    ...             solver="none", status="HEURISTIC", search_time_s=0.0,
    ...             stages=[StagePlan(index=0, layers=[0], budget_bytes=1, peak_memory_bytes=1,
    ...                               decisions=[Decision(node="mm", action="keep")])],
    ...             windows=[], predicted=Predicted(step_time_s=1.0, peak_memory_bytes=[1]))
    >>> Plan.from_json(plan.to_json()) == plan
    True
    >>> plan.stage_schedule(0).dropped
    frozenset()
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from lynx.errors import LynxFingerprintError, LynxPlanError

__all__ = [
    "SCHEMA_VERSION",
    "Decision",
    "StagePlan",
    "ChunkRecord",
    "WindowRecord",
    "WindowKind",
    "Predicted",
    "Plan",
    "HardwareSource",
    "StageSchedule",
    "fingerprint_of",
    "field_fingerprints",
    "check_fingerprint",
]

SCHEMA_VERSION = 1


class Decision(BaseModel):
    """What happens to one node's saved tensors.

    ``window`` is the window used for every microbatch when they all share one; ``windows``
    maps a microbatch to its window otherwise. A recomputed node with no window for a
    microbatch is recomputed on demand (on the critical path) for it. An offloaded node
    (``action="offload"``: copied to host memory after its forward) is prefetched in its window
    for a microbatch, else when the backward reaches ``prefetch_at`` (a node of the stage; None:
    when the backward starts).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str
    action: Literal["keep", "recompute", "offload"]
    window: Optional[str] = None
    windows: Optional[dict[int, str]] = None
    prefetch_at: Optional[str] = None

    def window_for(self, microbatch: int) -> Optional[str]:
        """The window this node is recomputed (or, offloaded, prefetched) in for ``microbatch``
        (None: kept, on demand, or streamed)."""
        if self.action == "keep":
            return None
        if self.windows is not None:
            return self.windows.get(microbatch)
        return self.window


class ChunkRecord(BaseModel):
    """One model chunk a device runs: its place in the pipeline, its blocks, its nodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int                   # pipeline position (0 .. pp·virtual − 1); device = index mod pp
    blocks: list[str]
    nodes: int                   # how many of the stage's decisions (in order) are this chunk's


class StagePlan(BaseModel):
    """One pipeline stage (device): its layers, budget, predicted peak and decisions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    layers: list[int]
    blocks: list[str] = []
    budget_bytes: int
    peak_memory_bytes: int
    static_bytes: int = 0
    activation_bytes: int = 0
    in_flight: int = 1
    exposed_recompute_s: float = 0.0
    hidden_recompute_s: float = 0.0
    # offload: bytes copied to the host per microbatch, pinned host memory held at most, and
    # seconds the stage's backwards waited on prefetches per step
    offloaded_bytes: int = 0
    host_bytes: int = 0
    exposed_copy_s: float = 0.0
    chunks: list[ChunkRecord] = []   # the device's model chunks in order (several: interleaved)
    decisions: list[Decision]


# what a stage waits for in a window (lynx.planner.windows.WINDOW_KINDS)
WindowKind = Literal["recv_grad", "recv_act", "tp_allreduce", "dp_collective"]


class WindowRecord(BaseModel):
    """An idle interval a stage could fill with recomputation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    stage: int
    kind: WindowKind
    microbatch: int
    capacity_s: float
    eligible_layers: Optional[list[int]] = None


class Predicted(BaseModel):
    """The simulator's figures for the plan (never the solver's own objective)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_time_s: float
    exposed_recompute_s: float = 0.0
    hidden_recompute_s: float = 0.0
    exposed_copy_s: float = 0.0      # backwards waiting on offload prefetches (summed over stages)
    bubble_s: float = 0.0
    peak_memory_bytes: list[int]
    fits_budget: bool = True


class HardwareSource(BaseModel):
    """The hardware file a plan's figures were read from, and how it was measured
    (:class:`lynx.planner.hardware.Calibration`'s fields, its notes left out; None: written by hand)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    file: Optional[str] = None
    calibration: Optional[dict[str, Any]] = None

    @classmethod
    def of(cls, spec: Any) -> Optional["HardwareSource"]:
        """``spec``'s source and calibration, or None for a preset."""
        calibration = getattr(spec, "calibration", None)
        if getattr(spec, "source", None) is None and calibration is None:
            return None
        return cls(file=spec.source,
                   calibration=None if calibration is None else calibration.model_dump(mode="json", exclude={"notes"}))

    def applied_to(self, spec: Any) -> Any:
        """``spec`` (the plan's recorded figures) with this source and calibration attached."""
        from lynx.planner.hardware import Calibration

        calibration = None if self.calibration is None else Calibration.model_validate(self.calibration)
        return spec.model_copy(update={"source": self.file, "calibration": calibration})


class Plan(BaseModel):
    """A complete recomputation plan; see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    fingerprint: str
    graph_fingerprint: str
    config: dict[str, Any]
    solver: str
    status: str
    gap: Optional[float] = None
    search_time_s: float
    iterations: int = 1
    stages: list[StagePlan]
    windows: list[WindowRecord]
    predicted: Predicted
    # the simulated step, merged per stage: (stage, compute|recompute|comm|idle, start_s, end_s)
    timeline: list[tuple[int, str, float, float]] = []
    # the same step bar by bar with microbatch labels (lynx.viz.timeline_detail): what `lynx show` draws
    timeline_detail: list[tuple[int, str, float, float, str]] = []
    # per fingerprinted setting, a hash of the value the plan was made for: names an edited config field
    config_fingerprints: dict[str, str] = {}
    # where the hardware figures came from, when a file gave them (``hardware_source``): not
    # fingerprinted — a run of the saved plan reports the calibration its prediction assumes
    hardware_source: Optional[HardwareSource] = None

    # ------------------------------------------------------------------ files
    def to_json(self, indent: Optional[int] = 1) -> str:
        """The plan as JSON text."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> "Plan":
        """Parse a plan; a corrupt or wrong-version text raises :class:`LynxPlanError`."""
        from lynx import json_files

        try:  # a key given twice or a NaN token is refused, not read as the last value or a number
            data = json_files.loads(text, f"plan {source}", error=LynxPlanError)
        except LynxPlanError as err:
            raise LynxPlanError(f"{err}; re-create it with `lynx plan`") from None
        if not isinstance(data, dict):
            raise LynxPlanError(f"plan {source} is corrupt: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise LynxPlanError(
                f"plan {source} has schema_version {version!r}; this Lynx reads version {SCHEMA_VERSION}. "
                f"Re-create the plan with this version of Lynx (`lynx plan`).")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise LynxPlanError(
                f"plan {source} is corrupt: {where}: {first.get('msg')} "
                f"({err.error_count()} problem(s)); re-create it with `lynx plan`") from None

    def save(self, path: Union[str, Path]) -> Path:
        """Write the plan as JSON; returns the path."""
        path = Path(path)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Plan":
        """Read a plan written by :meth:`save`."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise LynxPlanError(f"plan file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as err:
            raise LynxPlanError(f"cannot read plan file {path}: {err}") from None
        return cls.from_json(text, source=str(path))

    # -------------------------------------------------------------- accessors
    @property
    def microbatches(self) -> int:
        return int(self.config.get("microbatches", 1))

    def stage(self, index: int) -> StagePlan:
        """The plan of stage ``index``."""
        for stage in self.stages:
            if stage.index == index:
                return stage
        raise LynxPlanError(f"plan has no stage {index}; it has stages 0..{len(self.stages) - 1}")

    def stage_schedule(self, stage: int) -> "StageSchedule":
        """What the runtime does on ``stage``: the dropped nodes and, per microbatch j, the
        ordered ``(window id, [nodes in forward order])`` to recompute before ``B(j)`` — the
        window ids typed (:class:`~lynx.planner.windows.WindowId`), the plan's strings parsed."""
        from lynx.planner.windows import WindowId

        stage_plan = self.stage(stage)
        order = {w.id: i for i, w in enumerate(self.windows)}
        dropped = frozenset(d.node for d in stage_plan.decisions if d.action == "recompute")
        offloaded = [d for d in stage_plan.decisions if d.action == "offload"]

        def per_microbatch(decisions: list[Decision]) -> dict[int, list[tuple[Any, list[str]]]]:
            out = {}
            for j in range(self.microbatches):
                per_window: dict[str, list[str]] = {}
                for decision in decisions:  # decisions are in forward order
                    window = decision.window_for(j)
                    if window is not None:
                        per_window.setdefault(window, []).append(decision.node)
                ordered = sorted(per_window.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))
                out[j] = [(WindowId.parse(w), nodes) for w, nodes in ordered]
            return out

        prefetch = per_microbatch([d for d in stage_plan.decisions if d.action == "recompute"])
        return StageSchedule(dropped=dropped, prefetch=prefetch,
                             offloaded=frozenset(d.node for d in offloaded),
                             offload_prefetch=per_microbatch(offloaded) if offloaded else {},
                             prefetch_at={d.node: d.prefetch_at for d in offloaded})

    def recompute_fraction(self) -> float:
        """Share of nodes recomputed over all stages (a quick summary figure)."""
        total = sum(len(s.decisions) for s in self.stages)
        dropped = sum(1 for s in self.stages for d in s.decisions if d.action == "recompute")
        return dropped / total if total else 0.0

    def offload_fraction(self) -> float:
        """Share of nodes offloaded over all stages."""
        total = sum(len(s.decisions) for s in self.stages)
        moved = sum(1 for s in self.stages for d in s.decisions if d.action == "offload")
        return moved / total if total else 0.0


@dataclass(frozen=True)
class StageSchedule:
    """The runtime's view of one stage's plan (see :meth:`Plan.stage_schedule`)."""

    dropped: frozenset[str]
    prefetch: dict[int, list[tuple[Any, list[str]]]] = field(default_factory=dict)   # (WindowId, nodes)
    # offload: the offloaded nodes; per microbatch the (window, nodes) whose prefetch is issued
    # there; per offloaded node the node whose backward issues it otherwise (None: at its start)
    offloaded: frozenset[str] = frozenset()
    offload_prefetch: dict[int, list[tuple[Any, list[str]]]] = field(default_factory=dict)
    prefetch_at: dict[str, Optional[str]] = field(default_factory=dict)

    def on_demand(self, microbatch: int) -> frozenset[str]:
        """Dropped nodes not prefetched for ``microbatch``: recomputed when backward needs them."""
        prefetched = {n for _, nodes in self.prefetch.get(microbatch, []) for n in nodes}
        return self.dropped - prefetched


def fingerprint_of(graph_fingerprint: str, config_fields: dict[str, Any]) -> str:
    """Hash of the graph's fingerprint and the settings a plan depends on."""
    payload = json.dumps({"graph": graph_fingerprint, "config": config_fields}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def field_fingerprints(config_fields: dict[str, Any]) -> dict[str, str]:
    """A short hash of each setting's value (what :attr:`Plan.config_fingerprints` records)."""
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]
            for name, value in config_fields.items()}


def check_fingerprint(plan: Plan, graph_fingerprint: str, config_fields: dict[str, Any]) -> None:
    """Refuse ``plan`` unless it was made for this graph and these settings, naming what differs:
    a setting of this compilation, or a ``config`` field of the plan edited after it was made."""
    expected = fingerprint_of(graph_fingerprint, config_fields)
    if plan.fingerprint == expected:
        return
    differences = []
    if plan.graph_fingerprint != graph_fingerprint:
        differences.append(
            f"the model graph (plan made for graph {plan.graph_fingerprint}, this one is {graph_fingerprint})")
    for name, value in config_fields.items():
        planned = plan.config.get(name)
        if planned != value:
            differences.append(f"{name}: plan {planned!r}, now {value!r}")
    if not differences:   # the same settings as the plan records: its record was edited
        recorded = field_fingerprints({name: plan.config.get(name) for name in config_fields})
        differences = [f"config.{name} (the plan file records {plan.config.get(name)!r}, but the plan was made for "
                       f"another value: edited after it was made)"
                       for name, digest in recorded.items() if plan.config_fingerprints.get(name, digest) != digest]
    what = "; ".join(differences) or "the settings it was made for (its fingerprint was edited, or it predates " \
        "per-field fingerprints)"
    raise LynxFingerprintError(
        f"plan fingerprint {plan.fingerprint} does not match this model and config ({expected}): "
        f"differs in {what}. Make a new plan for this model and config (`lynx plan`, or drop plan=).")
