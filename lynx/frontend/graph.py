"""The op graph: a networkx DiGraph of profiled ops, tagged with repeated layers and blocks.

Repeated layers are found by structure, not by name: every module instance that owns ops gets
a structural hash (its ops, how they connect, their shapes), and the hash whose instances
cover the most ops, appearing at least twice in sequence, is a layer class. So blocks named
``layers.N``, ``h.N`` or ``block_a``/``block_b`` are all found. Ops before the first layer form
the ``pre`` edge block, ops after the last the ``post`` block.

When the capture was folded (a deep meta model captured with two of its repeated layers, see
:func:`lynx.frontend.capture.capture`), the second layer is replicated to the model's full depth here.

Example::

    >>> from lynx.frontend.capture import capture
    >>> from lynx.models import build_preset
    >>> from lynx.frontend.profile import profile
    >>> from lynx.frontend.graph import build_graph
    >>> model, inputs = build_preset("gpt-tiny", device="meta")
    >>> captured = capture(model, inputs)
    >>> G = build_graph(captured, profile(captured, target="cpu"))
    >>> G.graph["layer_classes"]
    {'GPTBlock': [0, 1, 2, 3]}
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import networkx as nx
from lynx.frontend.capture import Captured
from lynx.errors import LynxProfileError
from lynx.frontend.profile import NodeProfile, Profile

__all__ = ["build_graph", "find_layers", "LayerInstance", "CORE_ATTENTION_OPS"]

#: Ops that make up core attention when they work on (…, s, s) scores, or fuse it.
CORE_ATTENTION_OPS = {
    "aten.matmul.default", "aten.bmm.default", "aten.baddbmm.default", "aten.mul.Tensor", "aten.div.Tensor",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.softmax.int", "aten._softmax.default",
    "aten.dropout.default", "aten.add.Tensor", "aten.where.self",
}
_FUSED_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")


@dataclass
class LayerInstance:
    module_path: str
    layer_class: str
    nodes: list[str]  # execution order


def _structural_hash(names: list[str], prof: dict[str, NodeProfile]) -> str:
    position = {n: i for i, n in enumerate(names)}
    h = hashlib.sha1()
    for n in names:
        r = prof[n]
        refs = tuple(position[i] - position[n] if i in position else "ext" for i in r.inputs)
        h.update(repr((r.op.split("_")[0] if r.op.startswith("module:") else r.op, refs, r.output_shapes)).encode())
    return h.hexdigest()


def _class_name(path: str, type_names: dict[str, str]) -> str:
    return type_names.get(path, path).rsplit(".", 1)[-1] or path


def find_layers(order: list[str], prof: dict[str, NodeProfile], type_names: dict[str, str]) -> list[LayerInstance]:
    """Find repeated layer instances (two or more structurally identical modules in sequence)."""
    members: dict[str, list[str]] = defaultdict(list)
    for n in order:
        for path in prof[n].module_stack:
            if path:
                members[path].append(n)
    position = {n: i for i, n in enumerate(order)}
    taken: set[str] = set()
    layers: list[LayerInstance] = []
    while True:
        groups: dict[str, list[str]] = defaultdict(list)
        for path, nodes in members.items():
            if len(nodes) < 2 or taken.intersection(nodes):
                continue
            span = position[nodes[-1]] - position[nodes[0]] + 1
            if span != len(nodes):  # not a contiguous run of ops: not a layer
                continue
            groups[_structural_hash(nodes, prof)].append(path)
        best = max(
            (paths for paths in groups.values() if len(paths) >= 2),
            key=lambda paths: (len(paths) * len(members[paths[0]]), -position[members[paths[0]][0]]),
            default=None,
        )
        if best is None:
            break
        cls = _class_name(best[0], type_names)
        for path in best:
            layers.append(LayerInstance(path, cls, members[path]))
            taken.update(members[path])
    layers.sort(key=lambda layer: position[layer.nodes[0]])
    return layers


def _is_scores(shapes: list[tuple[int, ...]], seq: int | None) -> bool:
    """An (…, s, s) attention-score tensor."""
    return bool(shapes) and seq is not None and len(shapes[0]) >= 2 and shapes[0][-1] == seq and shapes[0][-2] == seq


def _core_attention(r: NodeProfile, seq: int | None, records: dict[str, NodeProfile]) -> bool:
    """QKᵀ, scaling, masking, softmax, dropout on the scores, and ·V (it reads the scores)."""
    if any(k in r.op for k in _FUSED_ATTENTION):
        return True
    if r.op not in CORE_ATTENTION_OPS:
        return False
    return _is_scores(r.output_shapes, seq) or any(_is_scores(records[i].output_shapes, seq) for i in r.inputs)


def _type_names(captured: Captured) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in captured.gm.graph.nodes:
        for path, type_name in (node.meta.get("nn_module_stack") or {}).values():
            names.setdefault(
                str(path),
                str(type_name if isinstance(type_name, str) else getattr(type_name, "__qualname__", type_name)),
            )
    return names


def _param_bytes(captured: Captured, paths: list[str]) -> int:
    total = 0
    for name, p in captured.gm.named_parameters():
        if any(name.startswith(path + ".") for path in paths if path):
            total += p.numel() * p.element_size()
    return total


def build_graph(captured: Captured, prof: Profile, dims: dict | None = None) -> nx.DiGraph:
    """Build the tagged op graph (see ``docs/architecture.md``, "The graph contract")."""
    order = list(prof.nodes)
    records = prof.nodes
    layers = find_layers(order, records, _type_names(captured))
    fold = captured.folded
    if fold is not None and len(layers) != 2:
        raise LynxProfileError(
            f"folded capture of {fold.path!r} should show 2 repeated layers, found {len(layers)}; "
            "capture without folding (capture(..., fold_repeats=False))"
        )
    seq = (dims or {}).get("seq")
    layer_of = {n: i for i, layer in enumerate(layers) for n in layer.nodes}
    first = min((order.index(layer.nodes[0]) for layer in layers), default=len(order))
    last = max((order.index(layer.nodes[-1]) for layer in layers), default=-1)

    blocks: list[dict] = []

    def new_block(name: str, kind: str, layer_class: str, layer: int | None, path: str) -> dict:
        block = {
            "index": len(blocks),
            "name": name,
            "kind": kind,
            "layer_class": layer_class,
            "layer": layer,
            "module_path": path,
            "nodes": [],
        }
        blocks.append(block)
        return block

    G = nx.DiGraph()
    current: dict | None = None
    edge_count = 0
    for i, n in enumerate(order):
        li = layer_of.get(n)
        if li is not None:
            if current is None or current["layer"] != li:
                layer = layers[li]
                current = new_block(layer.module_path, "layer", layer.layer_class, li, layer.module_path)
        elif current is None or current["kind"] != "edge":
            name = "pre" if i < first else "post" if i > last else f"edge{edge_count}"
            edge_count += 1
            current = new_block(name, "edge", name if name in ("pre", "post") else "edge", None, "")
        current["nodes"].append(n)
        r = records[n]
        G.add_node(
            n,
            op=r.op,
            flops=r.flops,
            input_bytes=r.input_bytes,
            output_bytes=r.output_bytes,
            saved_bytes=r.saved_bytes,
            output_saved=r.output_saved,
            output_saved_bytes=r.output_saved_bytes,
            output_saved_by=list(r.output_saved_by),
            backward_reach=r.backward_reach,
            is_view=r.is_view,
            forward_ops=r.forward_ops,
            backward_ops=r.backward_ops,
            forward_s=0.0,
            backward_s=0.0,
            block=current["index"],
            layer=current["layer"],
            layer_class=current["layer_class"],
            module_path=r.module_path,
            core_attention=_core_attention(r, seq, records),
            output_shapes=r.output_shapes,
        )
        for src in r.inputs:
            G.add_edge(src, n)
    for block in blocks:
        paths = [block["module_path"]] if block["kind"] == "layer" else []
        block["param_bytes"] = _param_bytes(captured, paths) if paths else 0
    if fold is not None:
        G, blocks = _unfold(G, blocks, fold.total)
    _add_edge_params(captured, blocks)
    classes: dict[str, list[int]] = defaultdict(list)
    for b in blocks:
        if b["kind"] == "layer":
            classes[b["layer_class"]].append(b["layer"])
    G.graph.update(
        blocks=blocks,
        layer_classes=dict(classes),
        target=prof.target,
        dims=dict(dims or {}),
        param_bytes=[b["param_bytes"] for b in blocks],
        emulated_ops=prof.emulated_ops,
        folded=None if fold is None else {"path": fold.path, "total": fold.total},
    )
    return G


def _add_edge_params(captured: Captured, blocks: list[dict]) -> None:
    """Parameters outside every layer belong to the block whose ops use them first."""
    attr_users: dict[str, set[str]] = defaultdict(set)
    for node in captured.gm.graph.nodes:
        if node.op == "get_attr":
            attr_users[str(node.target)].update(u.name for u in node.users)
    block_of = {n: b["index"] for b in blocks for n in b["nodes"]}
    params = dict(captured.gm.named_parameters())
    layer_paths = [b["module_path"] for b in blocks if b["kind"] == "layer"]
    for name, p in params.items():
        if any(name.startswith(path + ".") for path in layer_paths):
            continue
        users = [block_of[u] for u in attr_users.get(name, ()) if u in block_of]
        if users:
            blocks[min(users)]["param_bytes"] += p.numel() * p.element_size()


def _unfold(G: nx.DiGraph, blocks: list[dict], total: int) -> tuple[nx.DiGraph, list[dict]]:
    """Replicate the second of two captured layers until the model's full depth."""
    layer_blocks = [b for b in blocks if b["kind"] == "layer"]
    first, second = layer_blocks
    twin = dict(zip(first["nodes"], second["nodes"]))  # layer-0 node → its layer-1 counterpart
    pre = blocks[: first["index"]]
    post = blocks[second["index"] + 1 :]
    H = nx.DiGraph()
    out_blocks: list[dict] = []

    def copy_block(block: dict, **changes: object) -> dict:
        b = {**block, **changes, "index": len(out_blocks)}
        out_blocks.append(b)
        return b

    def clone_name(n: str, i: int) -> str:
        return n if i <= 1 else f"{n}__L{i}"

    def add(n: str, new: str, block: dict, layer: int | None, inputs: list[str], rename=lambda u: u) -> None:
        attrs = {**G.nodes[n], "block": block["index"], "layer": layer}
        if attrs.get("backward_reach"):   # the nodes a reader's gradient flows into, in this copy's place
            attrs["backward_reach"] = {part: [rename(r) if r else r for r in reach]
                                       for part, reach in attrs["backward_reach"].items()}
        H.add_node(new, **attrs)
        for src in inputs:
            H.add_edge(src, new)

    def name_in_layer(u: str, i: int) -> str:
        """Where input ``u`` of a node in layer ``i`` lives after unfolding."""
        if u in second["nodes"]:
            return clone_name(u, i)
        if u in twin:
            return clone_name(twin[u], i - 1) if i - 1 >= 1 else u
        return u

    for block in pre:
        b = copy_block(block)
        for n in block["nodes"]:
            add(n, n, b, None, list(G.predecessors(n)))
    b0 = copy_block(first)
    for n in first["nodes"]:
        add(n, n, b0, first["layer"], list(G.predecessors(n)))
    for i in range(1, total):
        b = copy_block(
            second, layer=i, name=f"{second['name']}[{i}]", nodes=[clone_name(n, i) for n in second["nodes"]]
        )
        for n in second["nodes"]:
            add(n, clone_name(n, i), b, i, [name_in_layer(u, i) for u in G.predecessors(n)],
                rename=lambda u, i=i: name_in_layer(u, i))
    for block in post:
        b = copy_block(block, nodes=list(block["nodes"]))
        for n in block["nodes"]:
            add(n, n, b, None, [name_in_layer(u, total - 1) for u in G.predecessors(n)],
                rename=lambda u: name_in_layer(u, total - 1))
    return H, out_blocks
