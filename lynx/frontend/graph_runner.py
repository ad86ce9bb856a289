"""The interpreter that runs a stage graph while its joint graph is traced.

:class:`GraphRunner` runs the captured stage graph with its parameters and buffers taken from
the primals being traced (:func:`lynx.frontend.joint.trace_joint`), skipping the capture's
baked-in metadata checks and input guards, cloning the outputs that alias an input, and — for
a graph profiled on fake CPU tensors — moving the device its factory ops name to the CPU
(:func:`on_profile_device`). :class:`lynx.frontend.joint_tp.TPRunner` subclasses it to run the
graph tensor-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from lynx.torch_private import tree_flatten, tree_map

__all__ = ["GraphRunner", "on_profile_device"]


class GraphRunner(fx.Interpreter):
    """Runs a stage graph with its attributes taken from ``attrs`` (the primals being traced).

    :mod:`lynx.frontend.joint_tp` subclasses it to run the graph tensor-parallel."""

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, Any], clone: frozenset[int], meta_to_cpu: bool) -> None:
        super().__init__(gm)
        self.attrs, self.clone, self.meta_to_cpu = attrs, clone, meta_to_cpu

    def fetch_attr(self, target: str) -> Any:
        return self.attrs[target]

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            return None  # the capture device's baked-in checks (a meta capture profiled on fake CPU)
        if n.op == "call_module" and n.target == "_guards_fn":
            return None  # export's input guards: checked when the model was captured
        return super().run_node(n)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.meta_to_cpu:  # profiled on fake CPU tensors: factory ops follow
            args, kwargs = tree_map(on_profile_device, (args, kwargs))
        return super().call_function(target, args, kwargs)

    def output(self, target: Any, args: Any, kwargs: Any) -> Any:
        flat, _ = tree_flatten(args[0])
        return tuple(v.clone() if i in self.clone else v for i, v in enumerate(flat))


def on_profile_device(value: Any) -> Any:
    """``value``, or the CPU where it is another device: a graph captured on meta or on a GPU
    (``arange(..., device=cuda:0)`` baked in) is profiled on fake CPU tensors, and the tensors
    its factory ops make must be on the device of the rest."""
    if isinstance(value, torch.device) and value.type != "cpu":
        return torch.device("cpu")
    return value
