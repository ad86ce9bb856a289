"""A synthetic GPT graph that follows the graph contract, for tests, benchmarks and examples.

Planning needs only the op graph (:mod:`lynx.planner.graph_schema`), so the planner can be
exercised at any size without capturing a model: :func:`synthetic_graph` builds a
Megatron-style GPT whose saved bytes per layer are Korthikanti's formula.

Example::

    >>> from lynx.planner.synthetic import synthetic_graph
    >>> g = synthetic_graph(layers=2, seq=8, hidden=16, heads=2)
    >>> [b["name"] for b in g.graph["blocks"]], len(g)
    (['pre', 'layers.0', 'layers.1', 'post'], 34)
"""

from __future__ import annotations

from typing import Any, Optional

import networkx as nx

__all__ = ["synthetic_graph"]


def synthetic_graph(*, layers: int = 4, seq: int = 1024, hidden: int = 1024, heads: int = 16,
                    microbatch: int = 1, flops_per_s: float = 1e14, bytes_per_s: float = 1e12,
                    vocab: int = 8192, heavy_post: float = 1.0) -> nx.DiGraph:
    """A Megatron-style GPT graph that follows the graph contract, without capturing a model.

    Per layer the 15-node chain ln1 → qkv → scores → softmax → attn_dropout → attn_v → proj →
    drop1 → add1 → ln2 → fc1 → gelu → fc2 → drop2 → add2 (saved bytes summing to Korthikanti's
    ``s·b·h·(34 + 5·a·s/h)`` in fp16), ``pre`` (embedding) and ``post`` (norm, head, loss).
    Backward costs twice the forward; ``heavy_post`` scales the head's cost (unbalanced stages).
    """
    s, b, h, a = seq, microbatch, hidden, heads
    sbh, as2b = s * b * h * 2, a * s * s * b * 2
    mm = lambda k: 2.0 * s * b * h * k * h / flops_per_s  # noqa: E731
    ew = lambda n: n / bytes_per_s  # noqa: E731
    attn = 4.0 * s * s * b * h / flops_per_s
    chain = [
        ("ln1", 2 * sbh, True, ew(2 * sbh), ["IN"], False),
        ("qkv", 6 * sbh, True, mm(3), ["ln1"], False),
        ("scores", 0, False, attn, ["qkv"], True),
        ("softmax", 2 * as2b, True, ew(2 * as2b), ["scores"], True),
        ("attn_dropout", 3 * as2b, True, ew(3 * as2b), ["softmax"], True),
        ("attn_v", 2 * sbh, True, attn, ["attn_dropout", "qkv"], True),
        ("proj", 0, False, mm(1), ["attn_v"], False),
        ("drop1", sbh, False, ew(2 * sbh), ["proj"], False),
        ("add1", 2 * sbh, True, ew(3 * sbh), ["drop1", "IN"], False),
        ("ln2", 2 * sbh, True, ew(2 * sbh), ["add1"], False),
        ("fc1", 8 * sbh, True, mm(4), ["ln2"], False),
        ("gelu", 8 * sbh, True, ew(8 * sbh), ["fc1"], False),
        ("fc2", 0, False, mm(4), ["gelu"], False),
        ("drop2", sbh, False, ew(2 * sbh), ["fc2"], False),
        ("add2", 2 * sbh, True, ew(3 * sbh), ["drop2", "add1"], False),
    ]
    g = nx.DiGraph()
    blocks: list[dict[str, Any]] = []

    def add(
        name: str,
        block: int,
        layer: Optional[int],
        cls: str,
        saved: int,
        out_saved: bool,
        fwd: float,
        inputs: list[str],
        core: bool,
        path: str,
    ) -> None:
        g.add_node(
            name,
            op="aten.synthetic.default",
            flops=int(fwd * flops_per_s),
            output_bytes=sbh,
            saved_bytes=saved,
            output_saved=out_saved,
            forward_s=fwd,
            backward_s=2 * fwd,
            block=block,
            layer=layer,
            layer_class=cls,
            module_path=path,
            core_attention=core,
        )
        for src in inputs:
            g.add_edge(src, name)

    add("embed", 0, None, "pre", 0, True, ew(2 * sbh), [], False, "embed")
    blocks.append(
        {
            "index": 0,
            "name": "pre",
            "kind": "edge",
            "layer_class": "pre",
            "layer": None,
            "module_path": "embed",
            "nodes": ["embed"],
        }
    )
    prev = "embed"
    for layer in range(layers):
        names = []
        for name, saved, out_saved, fwd, ins, core in chain:
            full = f"l{layer}_{name}"
            add(
                full,
                layer + 1,
                layer,
                "GPTBlock",
                saved,
                out_saved,
                fwd,
                [prev if i == "IN" else f"l{layer}_{i}" for i in ins],
                core,
                f"layers.{layer}.{name}",
            )
            names.append(full)
        blocks.append(
            {
                "index": layer + 1,
                "name": f"layers.{layer}",
                "kind": "layer",
                "layer_class": "GPTBlock",
                "layer": layer,
                "module_path": f"layers.{layer}",
                "nodes": names,
            }
        )
        prev = f"l{layer}_add2"
    post = len(blocks)
    add("ln_f", post, None, "post", 2 * sbh, True, ew(2 * sbh), [prev], False, "ln_f")
    add(
        "head",
        post,
        None,
        "post",
        2 * s * b * vocab * 2,
        True,
        heavy_post * 2.0 * s * b * h * vocab / flops_per_s,
        ["ln_f"],
        False,
        "head",
    )
    add("loss", post, None, "post", s * b * vocab * 4, False, ew(4 * s * b * vocab), ["head"], False, "loss")
    blocks.append(
        {
            "index": post,
            "name": "post",
            "kind": "edge",
            "layer_class": "post",
            "layer": None,
            "module_path": "",
            "nodes": ["ln_f", "head", "loss"],
        }
    )
    g.graph.update(
        blocks=blocks,
        layer_classes={"GPTBlock": list(range(layers))},
        target="cuda",
        dims={"hidden": h, "heads": a, "layers": layers, "seq": s, "microbatch": b, "dtype": "float16"},
        param_bytes=[vocab * h * 2] + [12 * h * h * 2] * layers + [2 * h * 2],
    )
    return g
