"""A one-stage pipeline reuses the joint graph the profile traced (:mod:`lynx.frontend.profile`).

At pp 1 (one chunk) the stage graph is the captured graph split into one part: the same nodes,
placeholders first and export's input guards left out. The profile traced that graph's joint
forward/backward on fake tensors (:func:`lynx.frontend.joint.profile_saved`); the stage would
trace it again on real ones (~1 CPU-s for llama-tiny). AOTAutograd traces on fake tensors either
way, so the two traces give the same graph when all of these hold (:func:`reusable` checks each;
any miss traces anew):

* the stage runs the same program: node for node the same ops on the same values, under the
  same captured-node names, with the same placeholders (the split's part covers the whole graph);
* the inputs have the profile's signature, and the real parameters and buffers the fake ones'
  (shape, dtype, device, whether a gradient is needed);
* no factory op names a device other than the CPU (the profile moves those to the CPU:
  :func:`lynx.frontend.graph_runner.on_profile_device`);
* the joint graph reads no tensor constant (``get_attr``): one lifted while profiling is a fake
  tensor, which the stage cannot run.

The profile's trace is kept on the captured graph module for this (:func:`remember`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["remember", "reusable", "link_whole", "same_program"]

_KEY = "lynx_profile_joint"
_WHOLE = "lynx_whole_of"


def remember(gm: fx.GraphModule, args: list[Any], attrs: dict[str, torch.Tensor], joint: Any) -> None:
    """Keep the profile's ``joint`` of ``gm`` traced on fake ``args`` and ``attrs``."""
    from lynx.frontend.joint import signature_of

    gm.meta[_KEY] = (signature_of(args), signature_of([attrs[name] for name in joint.attr_names]), joint)


def link_whole(part_gm: fx.GraphModule, gm: fx.GraphModule) -> None:
    """Mark ``part_gm`` as the single part of a split of ``gm`` (the candidate for :func:`reusable`)."""
    part_gm.meta[_WHOLE] = gm


def reusable(stage_gm: fx.GraphModule, args: list[Any]) -> Any:
    """The profile's joint graph of the captured graph ``stage_gm`` covers, where it is the graph
    a trace of ``stage_gm`` on ``args`` gives (module docstring); else ``None``."""
    from lynx.frontend.joint import fetch_attr, signature_of

    whole = stage_gm.meta.get(_WHOLE)
    if not isinstance(whole, fx.GraphModule) or _KEY not in whole.meta:
        return None
    found = whole.meta[_KEY]
    arg_sig, attr_sig, joint = found
    if arg_sig != signature_of(args) or any(n.op == "get_attr" for n in joint.gm.graph.nodes):
        return None
    if not same_program(whole, stage_gm):   # the same get_attr targets, so the same attr_names
        return None
    if signature_of([fetch_attr(stage_gm, name) for name in joint.attr_names]) != attr_sig:
        return None
    return joint


def same_program(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether ``a`` and ``b`` run the same ops on the same values under the same captured-node
    names, read the same attributes and take the same placeholders in order (placeholders'
    position among the other nodes and export's input guards aside), naming no device but the CPU."""
    return _program(a) == _program(b) != ()


def _program(gm: fx.GraphModule) -> tuple:
    def tag(n: fx.Node) -> str:
        return n.meta.get("lynx_name", n.name)

    def plain(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type != "cpu":
            raise _OtherDevice
        return value

    nodes = [n for n in gm.graph.nodes if not (n.op == "call_module" and n.target == "_guards_fn")]
    try:
        body = tuple((tag(n), n.op, n.target,
                      repr(fx.node.map_aggregate(fx.node.map_arg(n.args, lambda m: ("%", tag(m))), plain)),
                      repr(fx.node.map_aggregate(fx.node.map_arg(n.kwargs, lambda m: ("%", tag(m))), plain)))
                     for n in nodes if n.op != "placeholder")
    except _OtherDevice:
        return ()
    return tuple(tag(n) for n in nodes if n.op == "placeholder"), body


class _OtherDevice(Exception):
    pass
