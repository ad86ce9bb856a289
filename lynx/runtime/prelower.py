"""Lower a rank's model chunks when its :class:`~lynx.runtime.Pipeline` is built: ranks trace side by side.

A :class:`~lynx.rewrite.stage.StageModule` traces its joint forward/backward graph (AOTAutograd)
and partitions it along the plan on its first forward, for that forward's input signature
(shapes, dtypes, device, which inputs need a gradient). Left to the first step, stage s+1
traced only once stage s had traced, run its first forward and sent it the values: the first
step's traces ran one after another, rank after rank, each rank idle while the ranks before it
traced. :func:`lower_chunks` lowers them when the pipeline is built, on every rank at once, for
the signature the first step brings:

- a model input: the captured example's shape, dtype and layout on the rank's device, needing
  no gradient (what ``Pipeline.step`` copies each microbatch into);
- a received value: its boundary shape and dtype (what the runtime receives into), needing a
  gradient where the chunk that sends it returns one that does. Which do is found without a
  message: :func:`received_needs_grad` runs the chunks before it on fake tensors with autograd
  on, which is how AOTAutograd decides which outputs of the traced graph take a gradient.

Nothing else changes: the first forward finds the lowering under its signature. An input that
differs (another dtype, a tensor needing a gradient) is another signature, lowered at that
forward as before. A chunk whose lowering raises here is left to its first forward, which
raises the same error where the runtime reports a rank's errors (naming the rank), not while the
pipeline is being built and its failure handling is not yet in place.

Example (one process, two stages: the second receives a value that needs a gradient)::

    >>> import torch
    >>> from lynx.rewrite import build_stages
    >>> from lynx.rewrite.build import split_cached
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    >>> stages = build_stages(gm, [names[:1], names[1:]])
    >>> parts = split_cached(gm, [names[:1], names[1:]])
    >>> examples = {n.name: torch.randn(2, 4) for n in gm.graph.nodes if n.op == "placeholder"}
    >>> received_needs_grad(parts, examples, upto=1)
    {1: [True]}
    >>> lower_chunks(dict(enumerate(stages)), parts, examples, torch.device("cpu"))
    [0, 1]
    >>> traced = len(stages[1]._lowered)
    >>> y = stages[1](torch.randn(2, 4, requires_grad=True), microbatch=0)
    >>> len(stages[1]._lowered) == traced   # the first forward found its lowering
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lynx.frontend.graph_runner import GraphRunner
from lynx.frontend.joint import fetch_attr
from lynx.runtime.batching import match_layout
from lynx.rewrite.split import StageGraph
from lynx.runtime.p2p import boundary_meta
from lynx.torch_private import fake_tensor_mode

__all__ = ["lower_chunks", "received_needs_grad"]


def received_needs_grad(parts: Sequence[StageGraph], examples: Mapping[str, torch.Tensor],
                        upto: int) -> dict[int, list[bool]] | None:
    """For each chunk ``c`` in ``1..upto``, which of the values it receives (``parts[c].spec.recv``)
    need a gradient: chunks ``0..c-1`` (``parts``: every chunk's graph, unsharded, in pipeline
    order) run on fake tensors with autograd on, from the example inputs needing no gradient and
    the parameters as they are. None where the graphs do not run on fake tensors."""
    mode = fake_tensor_mode()

    def fake(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        with mode:   # all on the CPU, as profiling runs a model captured on any device (GraphRunner's meta_to_cpu)
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return out.requires_grad_(requires_grad and out.is_floating_point())

    flags: dict[int, list[bool]] = {}
    sent: dict[str, torch.Tensor] = {}
    try:
        with torch.enable_grad():
            for c in range(upto):
                gm, spec = parts[c].gm, parts[c].spec
                attrs = {str(n.target): fake(value, value.requires_grad) for n in gm.graph.nodes
                         if n.op == "get_attr" and isinstance(value := fetch_attr(gm, str(n.target)), torch.Tensor)}
                inputs = [fake(examples[name], False) for name in spec.inputs]
                # received as the runtime receives them: fresh leaves needing a gradient as the sender's did
                received = [fake(sent[name], sent[name].requires_grad) for name in spec.recv]
                with mode:
                    out = GraphRunner(gm, attrs, frozenset(), True).run(*inputs, *received)
                sent = dict(zip(spec.send, out))
                flags[c + 1] = [bool(sent[name].requires_grad) for name in parts[c + 1].spec.recv]
    except Exception:  # noqa: BLE001 - a graph fake tensors cannot run: its receivers lower at their first forward
        return None
    return flags


def lower_chunks(chunks: Mapping[int, Any], parts: Sequence[StageGraph], examples: Mapping[str, torch.Tensor],
                 device: torch.device) -> list[int]:
    """Lower each of a rank's ``chunks`` (chunk index → :class:`~lynx.rewrite.stage.StageModule`)
    for the inputs its first forward gets (module docstring); ``parts``: every chunk's graph,
    unsharded, in pipeline order (:func:`lynx.rewrite.build.split_cached`). Returns the chunks
    lowered (one that could not be is left to its first forward)."""
    last = max(chunks)
    needs_grad = received_needs_grad(parts, examples, last) if last > 0 else {}
    done = []
    for c, chunk in sorted(chunks.items()):
        if needs_grad is None and chunk.spec.recv:
            continue
        inputs = [match_layout(torch.zeros(examples[n].shape, dtype=examples[n].dtype), examples[n], device)
                  for n in chunk.spec.inputs]
        metas = boundary_meta(chunk.gm, chunk.spec.recv)
        received = [torch.zeros(meta.shape, dtype=meta.dtype, device=device).requires_grad_(
            flag and meta.dtype.is_floating_point) for meta, flag in zip(metas, (needs_grad or {}).get(c, []))]
        try:
            chunk.lowered(*inputs, *received)
        except Exception:  # noqa: BLE001 - raised again by the first forward, where the runtime names the rank
            continue
        done.append(c)
    return done
