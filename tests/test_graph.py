from dataclasses import replace

import networkx as nx
import pytest
import torch

from lynx.frontend.analyze import analyze
from lynx.frontend.capture import capture
from lynx.frontend.graph import build_graph
from lynx.models import GPT, PRESETS, GPTConfig, resolve_model
from lynx.models.gpt import GPTBlock
from lynx.frontend.profile import profile


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_one_repeated_class_covering_all_layers(name):
    m = resolve_model(name)
    G = analyze(m.model, m.example_inputs, dims=m.dims).graph
    classes = G.graph["layer_classes"]
    assert len(classes) == 1
    (indices,) = classes.values()
    assert indices == list(range(m.dims["layers"]))
    kinds = [b["kind"] for b in G.graph["blocks"]]
    assert kinds == ["edge"] + ["layer"] * m.dims["layers"] + ["edge"]
    assert nx.is_directed_acyclic_graph(G) and nx.is_weakly_connected(G)


class Unnamed(torch.nn.Module):
    """Blocks that are not in a `layers.N` list."""

    def __init__(self):
        super().__init__()
        cfg = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=3)
        self.emb = torch.nn.Embedding(64, 32)
        self.first, self.middle, self.last = GPTBlock(cfg), GPTBlock(cfg), GPTBlock(cfg)
        self.out = torch.nn.Linear(32, 64)

    def forward(self, idx):
        return self.out(self.last(self.middle(self.first(self.emb(idx))))).sum()


def test_repetition_found_by_structure_not_name():
    model = Unnamed()
    captured = capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    G = build_graph(captured, profile(captured, target="cpu"))
    assert G.graph["layer_classes"] == {"GPTBlock": [0, 1, 2]}
    assert [b["module_path"] for b in G.graph["blocks"] if b["kind"] == "layer"] == ["first", "middle", "last"]


def test_folded_graph_equals_unfolded_graph():
    m = resolve_model("gpt-tiny")
    cfg_layers = 9  # deep enough to fold
    with torch.device("meta"):
        model = GPT(replace(m.model.config, layers=cfg_layers))
    folded = analyze(model, m.example_inputs, fold_repeats=True).graph
    full = analyze(model, m.example_inputs, fold_repeats=False).graph
    assert folded.graph["folded"]["total"] == cfg_layers and full.graph["folded"] is None
    assert folded.number_of_nodes() == full.number_of_nodes()
    assert folded.number_of_edges() == full.number_of_edges()
    for bf, bu in zip(folded.graph["blocks"], full.graph["blocks"]):
        assert len(bf["nodes"]) == len(bu["nodes"])
        assert bf["param_bytes"] == bu["param_bytes"]
        for key in ("saved_bytes", "flops", "output_bytes"):
            assert sum(folded.nodes[n][key] for n in bf["nodes"]) == sum(full.nodes[n][key] for n in bu["nodes"])
    assert nx.is_isomorphic(folded, full)


def test_core_attention_is_tagged():
    m = resolve_model("gpt-tiny", attention="math")
    G = analyze(m.model, m.example_inputs, dims=m.dims).graph
    core = [n for n in G if G.nodes[n]["core_attention"]]
    assert {"aten.softmax.int", "aten.dropout.default", "aten.matmul.default"} <= {G.nodes[n]["op"] for n in core}
    per_layer = [n for n in core if G.nodes[n]["layer"] == 0]
    # QKᵀ, scale, mask, softmax, dropout and ·V
    assert [G.nodes[n]["op"].split(".")[1] for n in per_layer] == [
        "matmul", "mul", "masked_fill", "softmax", "dropout", "matmul"]
    m = resolve_model("gpt-tiny", attention="sdpa")
    G = analyze(m.model, m.example_inputs, dims=m.dims).graph
    assert {G.nodes[n]["op"] for n in G if G.nodes[n]["core_attention"]} == {
        "aten.scaled_dot_product_attention.default"
    }


def test_graph_contract_attributes():
    m = resolve_model("llama-tiny")
    a = analyze(m.model, m.example_inputs, dims=m.dims, hardware="a100-80g")
    G = a.graph
    for n in a.topo_order:
        attrs = G.nodes[n]
        for key in (
            "op",
            "flops",
            "output_bytes",
            "saved_bytes",
            "output_saved",
            "forward_s",
            "backward_s",
            "block",
            "layer",
            "layer_class",
            "module_path",
            "core_attention",
        ):
            assert key in attrs
    assert sum(b["param_bytes"] for b in G.graph["blocks"]) == sum(
        p.numel() * p.element_size() for p in m.model.parameters()
    )
