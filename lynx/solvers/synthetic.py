"""Synthetic stage problems: identical Megatron-style GPT layers with analytic bytes and times.

Used by tests, doctests and the solver-quality benchmark, where a profiled graph would be
slow or beside the point.

Example::

    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=0.01)
    >>> len(p.nodes), [w.id for w in p.windows][:2]
    (30, ['s0.recv_grad.mb0', 's0.recv_grad.mb1'])
"""

from __future__ import annotations

from collections.abc import Sequence

from lynx.planner.windows import WindowId
from lynx.solvers.problem import ProblemNode, ProblemWindow, StageProblem

__all__ = ["make_uniform_problem"]


def make_uniform_problem(
    *,
    layers: int = 4,
    hidden: int = 2048,
    heads: int = 16,
    seq: int = 2048,
    micro_batch: int = 1,
    dtype_bytes: int = 2,
    flops_per_s: float = 200e12,
    bytes_per_s: float = 2e12,
    microbatches: int = 8,
    in_flight: int = 4,
    budget_fraction: float | None = 0.5,
    budget_bytes: int | None = None,
    recv_grad_capacity_s: float | Sequence[float] = 0.0,
    tp_capacity_s: float = 0.0,
    dp_capacity_s: Sequence[float] = (),
    pre: bool = False,
    post: bool = False,
    stage: int = 0,
    layer_class: str = "GPTBlock",
    views: bool = False,
) -> StageProblem:
    """A synthetic stage of ``layers`` identical Megatron-style GPT layers.

    Each layer is the 14-node chain ln1 → qkv → scores → softmax → attn_dropout → attn_v →
    proj → drop1 → add1 → ln2 → fc1 → gelu → fc2 → drop2 → add2, with saved bytes that add
    up to Korthikanti et al.'s ``s·b·h·(34 + 5·a·s/h)`` per layer and recompute times from
    FLOPs (matmuls) or bytes moved (elementwise). Budget: ``budget_bytes`` if given, else
    ``budget_fraction`` of the keep-all peak (``in_flight`` × everything).

    ``views=True`` adds the zero-byte reshapes, transposes and weight transposes an aten
    graph has (29 nodes per layer), as real captured graphs do.

    Windows: one ``recv_grad`` window per microbatch (capacity a scalar or one per
    microbatch; zero-capacity windows are left out), optionally one ``tp_allreduce`` window
    per (microbatch, layer ≥ 1) in the backward of that layer serving layers below it, and
    ``dp_collective`` windows for the last microbatch serving the first layers.
    """
    s, b, h, a = seq, micro_batch, hidden, heads
    # Korthikanti et al.'s coefficients count bytes for a 16-bit dtype (a 1-byte dropout mask
    # is "sbh"); scale them for other widths.
    sbh = s * b * h * dtype_bytes // 2
    as2b = a * s * s * b * dtype_bytes // 2
    mm = lambda k: 2.0 * s * b * h * k * h / flops_per_s  # noqa: E731 — (s·b, h) @ (h, k·h)
    ew = lambda nbytes: nbytes / bytes_per_s  # noqa: E731 — memory-bound elementwise
    attn = 2.0 * 2.0 * s * s * b * h / flops_per_s  # QKᵀ or ·V
    # (name, saved, output_saved, recompute_s, inputs-within-layer (or "IN" for layer input), core)
    chain = [
        ("ln1", 2 * sbh, True, ew(2 * sbh), ("IN",), False),
        ("qkv", 6 * sbh, True, mm(3), ("ln1",), False),
        ("scores", 0, False, attn, ("qkv",), True),
        ("softmax", 2 * as2b, True, ew(2 * as2b), ("scores",), True),
        ("attn_dropout", 3 * as2b, True, ew(3 * as2b), ("softmax",), True),
        ("attn_v", 2 * sbh, True, attn, ("attn_dropout", "qkv"), True),
        ("proj", 0, False, mm(1), ("attn_v",), False),
        ("drop1", 1 * sbh, False, ew(2 * sbh), ("proj",), False),
        ("add1", 2 * sbh, True, ew(3 * sbh), ("drop1", "IN"), False),
        ("ln2", 2 * sbh, True, ew(2 * sbh), ("add1",), False),
        ("fc1", 8 * sbh, True, mm(4), ("ln2",), False),
        ("gelu", 8 * sbh, True, ew(8 * sbh), ("fc1",), False),
        ("fc2", 0, False, mm(4), ("gelu",), False),
        ("drop2", 1 * sbh, False, ew(2 * sbh), ("fc2",), False),
        ("add2", 2 * sbh, True, ew(3 * sbh), ("drop2", "add1"), False),
    ]
    if views:
        chain = _with_views(chain, ew(0), mm(0))
    nodes: list[ProblemNode] = []
    layer_input: str | None = None
    if pre:
        nodes.append(ProblemNode("pre.embed", 2 * sbh, True, ew(2 * sbh), (), None, "pre", False))
        layer_input = "pre.embed"
    for layer in range(layers):
        prefix = f"l{layer}."
        for name, saved, out_saved, cost, ins, core in chain:
            # "IN": the previous layer's output (none before the first layer)
            resolved = tuple(
                value for value in (layer_input if src == "IN" else prefix + src for src in ins) if value is not None
            )
            nodes.append(ProblemNode(prefix + name, saved, out_saved, cost, resolved, layer, layer_class, core))
        layer_input = prefix + "add2"
    if post:
        post_in = (layer_input,) if layer_input else ()
        vocab = 8 * h
        logits = s * b * vocab * dtype_bytes
        nodes.append(ProblemNode("post.ln", 2 * sbh, True, ew(2 * sbh), post_in, None, "post", False))
        nodes.append(ProblemNode("post.head", 2 * logits, True, mm(8), ("post.ln",), None, "post", False))
    windows: list[ProblemWindow] = []
    caps = (
        [recv_grad_capacity_s] * microbatches
        if isinstance(recv_grad_capacity_s, (int, float))
        else list(recv_grad_capacity_s)
    )
    if len(caps) != microbatches:
        raise ValueError(f"recv_grad_capacity_s has {len(caps)} entries for {microbatches} microbatches")
    for mb in range(microbatches):
        if caps[mb] > 0:
            windows.append(
                ProblemWindow(WindowId.recv(stage, "recv_grad", mb), "recv_grad", mb, float(caps[mb]), None)
            )
        if tp_capacity_s > 0:
            for layer in reversed(range(1, layers)):  # backward runs from the last layer down
                windows.append(
                    ProblemWindow(
                        WindowId.tp(stage, layer, mb), "tp_allreduce", mb, tp_capacity_s, tuple(range(layer))
                    )
                )
    for i, cap in enumerate(dp_capacity_s):
        last = microbatches - 1
        windows.append(
            ProblemWindow(
                WindowId.dp(stage, i), "dp_collective", last, float(cap), tuple(range(max(1, layers - 1 - i)))
            )
        )
    keep_all = in_flight * sum(n.saved_bytes for n in nodes)
    budget = (
        budget_bytes
        if budget_bytes is not None
        else int(keep_all * (budget_fraction if budget_fraction is not None else 1.0))
    )
    return StageProblem(
        stage=stage,
        nodes=tuple(nodes),
        windows=tuple(windows),
        microbatches=microbatches,
        in_flight=in_flight,
        activation_budget_bytes=budget,
    )


def _with_views(chain: list[tuple], view_s: float, _zero: float) -> list[tuple]:
    """Insert aten-style view/transpose nodes (no bytes of their own) into the layer chain."""
    out: list[tuple] = []
    tiny = 1e-7  # launch overhead of a view
    for name, saved, out_saved, cost, ins, core in chain:
        if name in ("qkv", "proj", "fc1", "fc2"):
            out.append((f"{name}_wt", 0, False, tiny, (), False))  # weight transpose
            ins = ins + (f"{name}_wt",)
        if name == "scores":
            ins = ("q_t", "k_t")
        if name == "attn_v":
            ins = ("attn_dropout", "v_t")
        if name == "proj":
            ins = ("ctx_view", f"{name}_wt")
        if name == "softmax":
            out.append(("scale", 0, False, cost / 4, ("scores",), True))
            out.append(("causal_mask", 0, False, cost / 4, ("scale",), True))
            ins = ("causal_mask",)
        out.append((name, saved, out_saved, cost, ins, core))
        if name == "qkv":
            out.append(("qkv_view", 0, False, tiny, ("qkv",), False))
            for t in ("q_t", "k_t", "v_t"):
                out.append((t, 0, False, tiny, ("qkv_view",), False))
        if name == "attn_v":
            out.append(("ctx_t", 0, False, tiny, ("attn_v",), False))
            out.append(("ctx_view", 0, False, tiny, ("ctx_t",), False))
    return out
