"""The backward graphs' gradient sums go in place only into buffers that die there; their
operator calls are bound directly; the gradients stay bitwise those of eager autograd."""

from __future__ import annotations

import torch
from torch import fx, nn

from lynx.frontend.joint import fetch_attr, trace_joint
from lynx.rewrite.fast_calls import bind_calls
from lynx.rewrite.inplace import accumulate_in_place
from lynx.rewrite.lower import lower

aten = torch.ops.aten


def _graph(build) -> fx.Graph:
    """A graph from ``build(graph, x, y)`` (two 4-float inputs), every value a 4-float tensor."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    out = build(g, x, y)
    g.output(tuple(out))
    for n in g.nodes:
        if n.op != "output":
            n.meta["val"] = torch.empty(4)
    return g


def _targets(g: fx.Graph) -> list:
    return [n.target for n in g.nodes if n.op == "call_function"]


def test_a_sum_goes_into_the_operand_that_dies_there_never_an_input() -> None:
    def build(g, x, y):
        m = g.call_function(aten.mul.Tensor, (x, y))
        return [g.call_function(aten.add.Tensor, (x, m))]   # x is an input: m takes the sum
    g = _graph(build)
    assert accumulate_in_place(g) == 1
    add = next(n for n in g.nodes if n.target is aten.add_.Tensor)
    assert add.args[0].target is aten.mul.Tensor


def test_a_sum_stays_out_of_place_when_its_operands_live_on() -> None:
    def later_reader(g, x, y):
        m = g.call_function(aten.mul.Tensor, (x, y))
        s = g.call_function(aten.add.Tensor, (m, y))
        return [s, g.call_function(aten.neg.default, (m,))]   # m is read after the sum

    def view_read_later(g, x, y):
        m = g.call_function(aten.mul.Tensor, (x, y))
        v = g.call_function(aten.view.default, (m, [2, 2]))
        s = g.call_function(aten.add.Tensor, (m, y))
        return [s, v]   # a view of m is returned

    def handed_over(g, x, y):
        m = g.call_function(aten.mul.Tensor, (x, y))
        g.call_function(print, (m,))   # something that may keep it
        return [g.call_function(aten.add.Tensor, (m, y))]

    for build in (later_reader, view_read_later, handed_over):
        g = _graph(build)
        assert accumulate_in_place(g) == 0, build.__name__
        assert aten.add_.Tensor not in _targets(g)


def test_a_chain_of_sums_accumulates_into_one_buffer() -> None:
    def build(g, x, y):
        a = g.call_function(aten.mul.Tensor, (x, y))
        b = g.call_function(aten.neg.default, (x,))
        c = g.call_function(aten.exp.default, (y,))
        s = g.call_function(aten.add.Tensor, (a, b))
        return [g.call_function(aten.add.Tensor, (s, c))]
    g = _graph(build)
    assert accumulate_in_place(g) == 2
    gm = fx.GraphModule({}, g)
    x, y = torch.randn(4), torch.randn(4)
    expected = x * y + -x + y.exp()
    assert torch.equal(gm(x, y)[0], expected)
    assert torch.equal(bind_calls(gm)(x, y)[0], expected)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = x + self.fc2(torch.relu(self.fc1(self.ln(x))))
        return x


def test_a_residual_stage_sums_gradients_in_place_bitwise_equal_to_autograd() -> None:
    torch.manual_seed(0)
    model, x, g = _Residual(), torch.randn(4, 8), torch.randn(4, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    lowered = lower(trace_joint(gm, [x]), dropped=set())
    graph = lowered.backward_graph(frozenset())
    assert aten.add_.Tensor in _targets(graph.gm.graph)
    assert aten.add.Tensor not in _targets(graph.gm.graph)
    assert "torch.ops.aten" in graph.gm.code and graph.run is not graph.gm   # calls bound

    xs = x.clone().requires_grad_()
    gm(xs).backward(g)   # eager autograd on the same module: the reference
    attrs = [fetch_attr(gm, name) for name in lowered.joint.attr_names]
    values = lowered.run_forward(*[a.detach() for a in attrs], x)
    kept = list(values[lowered.joint.n_outputs:])
    grads = graph.run([kept[i] for i in graph.in_slots] + [g.clone()])
    expected = [a.grad for a in attrs] + [xs.grad]
    assert len(grads) == len(lowered.grad_of) and grads
    for index, grad in zip(lowered.grad_of, grads):
        assert torch.equal(grad, expected[index])
