"""What ``lynx inspect`` reports: per layer and per layer class FLOPs, saved bytes and times.

Example::

    >>> from lynx.frontend.inspect import inspect_model
    >>> from lynx.models import build_preset
    >>> model, inputs = build_preset("gpt-tiny", device="meta")
    >>> report = inspect_model(model, inputs, target="cpu", hardware="cpu-local")
    >>> [c.layer_class for c in report.classes]
    ['pre', 'GPTBlock', 'post']
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from lynx.frontend.analyze import Analysis, analyze
from lynx.planner.hardware import HardwareSpec

__all__ = ["LayerReport", "ClassReport", "Totals", "InspectReport", "inspect_model", "report_from_analysis"]


class LayerReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    index: int | None  # repeated-layer index; None for edge blocks
    block: str
    layer_class: str
    nodes: int
    flops: int
    saved_bytes: int
    param_bytes: int
    forward_s: float
    backward_s: float


class ClassReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    layer_class: str
    count: int
    nodes: int  # per instance
    flops: int  # per instance
    saved_bytes: int  # per instance
    forward_s: float  # per instance
    backward_s: float  # per instance


class Totals(BaseModel):
    model_config = ConfigDict(frozen=True)
    flops: int
    saved_bytes: int
    forward_s: float
    backward_s: float


class InspectReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    model: str
    target: str
    hardware: str
    capture: str
    folded: bool
    emulated_ops: list[str]
    dims: dict[str, Any]
    layers: list[LayerReport]
    classes: list[ClassReport]
    totals: Totals

    def json_record(self) -> dict[str, Any]:
        """The ``--json`` schema of ``lynx inspect``."""
        keys = ("hidden", "heads", "layers", "seq", "microbatch", "dtype")
        return {
            "model": self.model,
            "target": self.target,
            "dims": {k: self.dims.get(k) for k in keys},
            "layers": [
                {"index": layer.index, "layer_class": layer.layer_class, "flops": layer.flops,
                 "saved_bytes": layer.saved_bytes, "forward_s": layer.forward_s, "backward_s": layer.backward_s}
                for layer in self.layers
            ],
            "totals": self.totals.model_dump(),
        }


def report_from_analysis(analysis: Analysis) -> InspectReport:
    G = analysis.graph
    layers = []
    for block in G.graph["blocks"]:
        attrs = [G.nodes[n] for n in block["nodes"]]
        layers.append(LayerReport(
            index=block["layer"], block=block["name"], layer_class=block["layer_class"], nodes=len(attrs),
            flops=sum(a["flops"] for a in attrs), saved_bytes=sum(a["saved_bytes"] for a in attrs),
            param_bytes=block["param_bytes"], forward_s=sum(a["forward_s"] for a in attrs),
            backward_s=sum(a["backward_s"] for a in attrs),
        ))
    classes: dict[str, list[LayerReport]] = {}
    for layer in layers:
        classes.setdefault(layer.layer_class, []).append(layer)
    class_reports = [
        ClassReport(layer_class=cls, count=len(group), nodes=group[0].nodes, flops=group[0].flops,
                    saved_bytes=group[0].saved_bytes, forward_s=group[0].forward_s, backward_s=group[0].backward_s)
        for cls, group in classes.items()
    ]
    totals = Totals(
        flops=sum(x.flops for x in layers), saved_bytes=sum(x.saved_bytes for x in layers),
        forward_s=sum(x.forward_s for x in layers), backward_s=sum(x.backward_s for x in layers),
    )
    return InspectReport(
        model=analysis.name, target=analysis.target, hardware=analysis.hardware.name,
        capture=analysis.captured.method, folded=analysis.captured.folded is not None,
        emulated_ops=analysis.profile.emulated_ops, dims=analysis.dims, layers=layers,
        classes=class_reports, totals=totals,
    )


def inspect_model(
    model: nn.Module,
    example_inputs: tuple | list | torch.Tensor,
    *,
    target: str | None = None,
    hardware: str | HardwareSpec = "h100-sxm",
    times: str = "analytic",
    dims: dict[str, Any] | None = None,
    name: str | None = None,
) -> InspectReport:
    """Analyze ``model`` and summarise it per layer, per layer class and in total."""
    analysis = analyze(model, example_inputs, target=target, hardware=hardware, times=times,  # type: ignore[arg-type]
                       dims=dims, name=name)
    return report_from_analysis(analysis)
