"""One call from a model to its measured, timed op graph: capture → profile → graph → cost.

Example::

    >>> from lynx.frontend.analyze import analyze
    >>> from lynx.models import build_preset
    >>> model, inputs = build_preset("gpt-tiny", device="meta")
    >>> a = analyze(model, inputs, hardware="a100-80g")
    >>> a.target, len(a.graph.graph["layer_classes"]["GPTBlock"])
    ('cuda', 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
import torch
from torch import nn

from lynx.frontend.capture import Captured, capture
from lynx.frontend.measure import measure_times
from lynx.planner.cost import annotate_times
from lynx.errors import LynxConfigError
from lynx.frontend.graph import build_graph
from lynx.planner.hardware import HardwareSpec
from lynx.planner.hardware_ref import resolve_hardware
from lynx.models.presets import infer_dims
from lynx.phases import Phases
from lynx.frontend.profile import TARGETS, Profile
from lynx.frontend.profile_cache import cached_profile

__all__ = ["Analysis", "analyze"]


@dataclass
class Analysis:
    """A model as Lynx sees it: the capture, the profile and the tagged op graph with times."""

    captured: Captured
    profile: Profile
    graph: nx.DiGraph
    hardware: HardwareSpec
    dims: dict[str, Any]
    name: str
    phases: Phases = field(default_factory=Phases)  # capture, profile, graph seconds (lynx.phases)

    @property
    def target(self) -> str:
        return self.profile.target

    @property
    def topo_order(self) -> list[str]:
        """Op nodes in forward execution order."""
        return [n for block in self.graph.graph["blocks"] for n in block["nodes"]]


def analyze(
    model: nn.Module,
    example_inputs: tuple | list | Mapping | torch.Tensor,
    *,
    target: str | None = None,
    hardware: str | HardwareSpec = "h100-sxm",
    times: Literal["analytic", "measure"] = "analytic",
    dims: dict[str, Any] | None = None,
    name: str | None = None,
    fold_repeats: bool | None = None,
) -> Analysis:
    """Capture, profile (for ``target``, default the hardware's device; a graph profiled before is
    read from the cache, :mod:`lynx.frontend.profile_cache`) and time ``model``."""
    hw = resolve_hardware(hardware)
    target = target or hw.device
    if target not in TARGETS:
        raise LynxConfigError(f"unknown target {target!r}; use one of {TARGETS}")
    if times not in ("analytic", "measure"):
        raise LynxConfigError(f"times must be 'analytic' or 'measure', got {times!r}")
    if isinstance(example_inputs, Mapping):  # by keyword: capture keeps the names
        inputs: Any = dict(example_inputs)
        values = tuple(inputs.values())
    else:
        inputs = values = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    dims = {**infer_dims(model, values), **(dims or {})} if isinstance(model, nn.Module) else dict(dims or {})
    phases = Phases()
    with phases.timed("capture"):
        captured = capture(model, inputs, fold_repeats=False if times == "measure" else fold_repeats)
    with phases.timed("profile"):
        prof = cached_profile(captured, target)
    with phases.timed("graph"):
        G = build_graph(captured, prof, dims)
        annotate_times(G, hw, dims.get("dtype") or prof.dtype)
        if times == "measure":
            measure_times(G, captured)
    return Analysis(captured, prof, G, hw, dims, name or type(model).__name__, phases)
