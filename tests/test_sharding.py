"""Tensor-parallel sharding plans and what a TP rank costs (no processes: see
tests/runtime/test_tp_pipeline.py for the runs).

The default plan found from the repeated layer (Megatron's layout) for lynx's GPT (fused q/k/v
split in three) and Llama (GQA, SwiGLU), a plain nn.Module; overrides in torchtitan's form;
errors naming the module; the planner's per-rank costs (sharded ops' arithmetic 1/tp, their
per-op host cost and replicated ones whole, two all-reduces each way per layer, parameters of
the sharded linears 1/tp); the memory model's TP windows; the runtime's check of the collectives a traced stage issues.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lynx
from lynx.errors import LynxConfigError
from lynx.frontend.analyze import analyze
from lynx.frontend.joint_tp import check_collectives
from lynx.frontend.sharding import LinearShard, resolve_sharding, shard_tensor
from lynx.frontend.tp_profile import annotate_tp, expected_collectives


def _analysis(name: str):
    model, inputs = lynx.models.build_preset(name, device="meta")
    return analyze(model, inputs, hardware="cpu-local")


@pytest.fixture(scope="module")
def gpt():
    return _analysis("gpt-tiny")


@pytest.fixture(scope="module")
def llama():
    return _analysis("llama-tiny")


def test_default_plans_follow_megatron(gpt, llama):
    assert resolve_sharding(gpt.captured.gm, gpt.graph.graph["blocks"], 2).record() == {
        "layers.*.attn.qkv": "colwise:3", "layers.*.attn.proj": "rowwise",
        "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}
    plan = resolve_sharding(llama.captured.gm, llama.graph.graph["blocks"], 2)
    assert plan.record() == {"layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise",
                             "layers.*.attn.wv": "colwise", "layers.*.attn.wo": "rowwise",
                             "layers.*.ffn.w1": "colwise", "layers.*.ffn.w3": "colwise",
                             "layers.*.ffn.w2": "rowwise"}
    # embeddings, norms and the head stay replicated
    assert plan.shard_of("tok_emb.weight") is None and plan.shard_of("head.weight") is None
    assert plan.sharded_params(["layers.0.attn.wo.weight", "layers.0.attn.wq.weight", "norm.weight"]) == {
        "layers.0.attn.wo.weight": (LinearShard("rowwise"), "weight"),
        "layers.0.attn.wq.weight": (LinearShard("colwise"), "weight")}


def test_a_fused_colwise_shard_holds_its_slice_of_each_part():
    w = torch.arange(12.0).view(6, 2)            # q rows 0-1, k rows 2-3, v rows 4-5
    rank1 = shard_tensor(w, LinearShard("colwise", parts=3), "weight", rank=1, tp=2)
    assert rank1[:, 0].tolist() == [2.0, 6.0, 10.0]
    row = shard_tensor(torch.arange(8.0).view(2, 4), LinearShard("rowwise"), "weight", rank=0, tp=2)
    assert row.tolist() == [[0.0, 1.0], [4.0, 5.0]]


def test_overrides_in_torchtitans_form(llama):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = resolve_sharding(llama.captured.gm, llama.graph.graph["blocks"], 2,
                            {"layers.*.ffn.w1": ColwiseParallel(), "layers.*.ffn.w3": "colwise",
                             "layers.*.ffn.w2": RowwiseParallel()})
    assert set(plan.shards) == {f"layers.{i}.ffn.{w}" for i in range(4) for w in ("w1", "w2", "w3")}


@pytest.mark.parametrize("tp_plan,tp,words", [
    (None, 8, ["layers.0.attn.wq", "4 attention heads", "tp=8"]),
    (None, 4, ["layers.0.attn.wk", "2 attention heads", "key/value heads"]),
    ({"layers.*.attn": "colwise"}, 2, ["'layers.0.attn'", "not a linear layer", "layers.0.attn.wq"]),
    ({"layers.*.nope": "colwise"}, 2, ["matches no module"]),
    ({"layers.*.ffn.w1": "diagonal"}, 2, ["unknown tensor-parallel style"]),
    ({"layers.*.ffn.w2": "rowwise"}, 3, ["layers.0.ffn.w2", "172 input features", "tp=3"]),
])
def test_bad_plans_are_refused_naming_the_module(llama, tp_plan, tp, words):
    with pytest.raises(LynxConfigError) as err:
        resolve_sharding(llama.captured.gm, llama.graph.graph["blocks"], tp, tp_plan)
    for word in words:
        assert word in str(err.value)


def test_sequence_parallel_and_other_layouts_are_refused(llama):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    with pytest.raises(LynxConfigError, match="SequenceParallel is not supported"):
        resolve_sharding(llama.captured.gm, llama.graph.graph["blocks"], 2, {"layers.*.attn_norm": SequenceParallel()})
    with pytest.raises(LynxConfigError, match="ColwiseParallel with input_layouts"):
        resolve_sharding(llama.captured.gm, llama.graph.graph["blocks"], 2,
                         {"layers.*.ffn.w1": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})


class _Gate(nn.Module):
    """A layer the default cannot shard: a linear whose output gates the residual directly."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(x) * torch.sigmoid(self.gate(x))


class _GateModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Gate() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_layer_the_default_cannot_shard_is_named():
    a = analyze(_GateModel(), (torch.randn(2, 8),), hardware="cpu-local")
    with pytest.raises(LynxConfigError, match=r"cannot shard layer 'layers\.\d'.*'layers\.\d\.up'.*tp_plan="):
        resolve_sharding(a.captured.gm, a.graph.graph["blocks"], 2)


def test_a_rank_costs_its_shard(gpt):
    from lynx.planner.problems import build_pipeline, build_problems, static_bytes
    from lynx.planner.timeline import run_timeline

    graph = gpt.graph.copy()
    graph.graph = {**gpt.graph.graph, "blocks": [dict(b) for b in gpt.graph.graph["blocks"]]}
    plan = resolve_sharding(gpt.captured.gm, graph.graph["blocks"], 2)
    annotate_tp(graph, gpt.captured.gm, plan)
    nodes = graph.nodes
    assert nodes["layer_norm"]["tp_compute"] == "replicate"        # ln1 of layer 0: whole on each rank
    fc1 = next(n for n in nodes if nodes[n]["module_path"] == "layers.0.mlp.fc1")
    fc2 = next(n for n in nodes if nodes[n]["module_path"] == "layers.0.mlp.fc2")
    assert (nodes[fc1]["tp_compute"], nodes[fc1]["tp_output"]) == ("shard", "shard")
    assert (nodes[fc2]["tp_compute"], nodes[fc2]["tp_output"]) == ("shard", "replicate")
    activation = 1 * 32 * 64 * 4                                     # b · s · h fp32
    assert expected_collectives(graph)[0] == {"forward": [activation] * 2, "backward": [activation] * 2}
    pipe = build_pipeline(graph, pp=1, microbatches=2, tp=2, hardware=gpt.hardware)
    cost = pipe.costs[1]
    from lynx.planner.comm import CommModel

    comm = CommModel.from_hardware(gpt.hardware, tp=2, dp=1, optimizer="adamw")
    assert cost.tp_forward_s == pytest.approx(2 * comm.tp_allreduce(activation))
    # replicated norms and adds run whole, the sharded rest's arithmetic in halves; every op's host
    # cost (the generated code dispatching it) whole on each rank
    layer = graph.graph["blocks"][1]["nodes"]
    whole = sum(nodes[n]["forward_s"] for n in layer)
    replicated = sum(nodes[n]["forward_s"] for n in layer if nodes[n]["tp_compute"] == "replicate")
    host = sum(nodes[n]["forward_host_s"] for n in layer if nodes[n]["tp_compute"] == "shard")
    assert host == pytest.approx(gpt.hardware.op_overhead_s * sum(nodes[n]["forward_ops"] for n in layer
                                                                  if nodes[n]["tp_compute"] == "shard"))
    assert 0 < host < whole - replicated
    assert cost.forward_s == pytest.approx(replicated + host + (whole - replicated - host) / 2)
    sharded = graph.graph["blocks"][1]["tp_sharded_param_bytes"]
    assert 0 < sharded < graph.graph["param_bytes"][1]
    assert cost.param_bytes == graph.graph["param_bytes"][1] - sharded // 2
    problems = build_problems(graph, pipe, run_timeline(pipe), budget_bytes=1 << 30,
                              static=static_bytes(graph, pipe, optimizer="adamw"), tp=2)
    by_name = {n.name: n for n in problems[0].nodes}
    assert by_name["layer_norm"].saved_bytes == nodes["layer_norm"]["saved_bytes"]
    assert by_name[fc1].saved_bytes == -(-nodes[fc1]["saved_bytes"] // 2)
    assert by_name[fc2].sent and fc2 not in by_name["dropout_2"].inputs   # the all-reduced output is held
    assert by_name[fc1].tp_collective


def test_the_runtime_refuses_collectives_the_plan_did_not_price():
    expected = {0: {"forward": [64, 64], "backward": [64, 64]}, None: {"forward": [], "backward": []}}
    issued = {0: {"forward": [("all_reduce", 64)] * 2, "backward": [("all_reduce", 64)] * 2}}
    check_collectives(issued, expected, stage=0)
    issued[0]["forward"].append(("all_gather_into_tensor", 32))
    with pytest.raises(LynxConfigError, match=r"stage 0: .*all_gather_into_tensor.*forward layer 0"):
        check_collectives(issued, expected, stage=0)


def test_tp_plan_needs_tp_and_is_fingerprinted():
    from lynx.config import CompileConfig

    with pytest.raises(LynxConfigError, match="tp_plan .* needs tp > 1"):
        CompileConfig(tp_plan={"layers.*.fc": "colwise"})
    a = CompileConfig(tp=2, tp_plan={"layers.*.fc": "colwise"}).fingerprint_fields()
    b = CompileConfig(tp=2, tp_plan={"layers.*.fc": "rowwise"}).fingerprint_fields()
    assert a["tp_plan"] == {"layers.*.fc": "colwise"} and a != b
    assert "tp_plan" not in CompileConfig().fingerprint_fields()   # tp = 1 plans keep their fingerprints


def test_compile_records_the_resolved_plan():
    model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    compiled = lynx.compile(model, inputs, pp=2, tp=2, microbatches=2, solver="none", hardware="cpu-local")
    assert compiled.plan.config["tp_plan"]["layers.*.attn.qkv"] == "colwise:3"
    assert compiled.sharding.tp == 2 and compiled.sharding.collectives[0]["backward"]
