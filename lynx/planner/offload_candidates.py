"""Which saved values are worth offloading, and why: what ``lynx inspect`` prints.

Every node that saves something for its backward may be offloaded: its saved bytes copied to
host memory after its forward and back before its backward (``docs/concepts.md``). What
decides whether a plan *should* is the trade the solvers make per byte: recomputing the node
costs compute time on the critical path (unless a window hides it), copying it costs only
time on the host link's copy lanes, which run beside compute — as long as they have room. So
a value dear to recompute per byte (a matmul's output) is offloaded first; one cheap to
recompute (a norm, an activation function, a dropout mask) is better recomputed, and offloaded
only where the lanes would otherwise idle. (Per value, a copy over PCIe usually takes longer
than recomputing it on the GPU; offload pays because the lanes run beside compute.) A value
a stage sends to the next one is held until its backward whatever the plan says: never
offloaded (which values those are depends on where the stages are cut, so it is not known
here). On a CPU device copies run on the compute
thread: offload then costs as much compute as the copy takes.

Example::

    >>> import lynx
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="meta", seq=512, microbatch=64)
    >>> analysis = lynx.analyze(model, inputs, target="cuda", hardware="h100-sxm")
    >>> found = offload_candidates(analysis.graph, analysis.hardware)
    >>> sorted({c.verdict for c in found})
    ['offload first', 'recompute first']
    >>> [c.node for c in found if c.layer_class == "GPTBlock" and c.verdict == "offload first"][:1]
    ['matmul']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lynx.planner.host_link import copy_seconds, host_link_of

__all__ = ["OffloadCandidate", "offload_candidates"]


@dataclass(frozen=True)
class OffloadCandidate:
    """One saved value of a layer class's first instance (or an edge block): the trade."""

    node: str
    layer_class: str
    op: str
    saved_bytes: int
    recompute_s: float     # running its forward again
    copy_s: float          # one device→host copy of its saved bytes over the host link
    verdict: str           # "offload first" | "recompute first"
    why: str

    def record(self) -> dict[str, Any]:
        return {"node": self.node, "layer_class": self.layer_class, "op": self.op, "saved_bytes": self.saved_bytes,
                "recompute_s": self.recompute_s, "copy_s": self.copy_s, "verdict": self.verdict, "why": self.why}


def offload_candidates(graph: Any, hardware: Any) -> list[OffloadCandidate]:
    """The saved values of each layer class's first instance and of the edge blocks, with the
    verdict and its reason (see the module docstring): the dearer half to recompute per byte
    "offload first" (the order the solvers fill the copy lanes in), the rest "recompute first".
    Raises ``LynxConfigError`` naming how to give one when ``hardware`` has no host link."""
    link = host_link_of(hardware)
    seen: set[str] = set()
    found = []
    for block in graph.graph["blocks"]:
        cls = block["layer_class"]
        if block["layer"] is not None and cls in seen:
            continue   # identical layers: the first instance speaks for them
        seen.add(cls)
        for name in block["nodes"]:
            attrs = graph.nodes[name]
            if int(attrs["saved_bytes"]) > 0:
                found.append((name, cls, attrs))
    per_byte = sorted(float(a["forward_s"]) / int(a["saved_bytes"]) for _n, _c, a in found)
    median = per_byte[len(per_byte) // 2] if per_byte else 0.0
    out = []
    for name, cls, attrs in found:
        nbytes = int(attrs["saved_bytes"])
        recompute, copy = float(attrs["forward_s"]), copy_seconds(link, nbytes, "d2h")
        dear = recompute / nbytes >= median and recompute > 0
        verdict = "offload first" if dear else "recompute first"
        cost = f"recomputing it costs {_ms(recompute)} of compute ({_per_mib(recompute, nbytes)})"
        if link.synchronous:
            why = f"{cost}; copies run on the compute thread here, out and back {_ms(2 * copy)}"
        elif dear:
            why = (f"{cost}, among the dearest per byte; its copy takes {_ms(copy)} on a lane beside compute, "
                   "free while the lanes have room")
        else:
            why = (f"{cost}, cheap per byte: recomputed unless the copy lanes have room left "
                   f"({_ms(copy)} out, as much back)")
        out.append(OffloadCandidate(node=name, layer_class=cls, op=str(attrs.get("op", "")), saved_bytes=nbytes,
                                    recompute_s=recompute, copy_s=copy, verdict=verdict, why=why))
    return out


def _per_mib(seconds: float, nbytes: int) -> str:
    return f"{_ms(seconds * 2**20 / nbytes)} per MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} µs"
