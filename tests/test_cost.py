import pytest

from lynx.frontend.analyze import analyze
from lynx.planner.cost import (allgather_time, allreduce_time, alltoall_time, node_backward_s, node_forward_s,
                       p2p_time, reduce_scatter_time)
from lynx.errors import LynxConfigError
from lynx.planner.hardware import HARDWARE_PRESETS, HardwareSpec, LinkSpec, get_hardware
from lynx.models import build_preset

LINK = LinkSpec(alpha_s=1e-5, beta_bytes_per_s=1e9)


def test_ring_collective_formulas():
    n = 8e6
    assert p2p_time(n, LINK) == pytest.approx(1e-5 + n / 1e9)
    assert allreduce_time(n, 8, LINK) == pytest.approx(14 * 1e-5 + 2 * 7 / 8 * n / 1e9)
    assert allgather_time(n, 4, LINK) == pytest.approx(3 * 1e-5 + 3 * n / 1e9)
    assert reduce_scatter_time(n, 4, LINK) == pytest.approx(3 * 1e-5 + 3 / 4 * n / 1e9)
    assert alltoall_time(n, 4, LINK) == pytest.approx(3 * 1e-5 + 3 / 4 * n / 1e9)
    assert allreduce_time(n, 1, LINK) == 0.0
    with pytest.raises(LynxConfigError):
        allreduce_time(-1, 2, LINK)


def test_roofline_compute_and_memory_bound():
    hw = get_hardware("a100-80g")
    matmul = {"flops": 2 * 4096**3, "input_bytes": 2 * 2 * 4096**2, "output_bytes": 2 * 4096**2, "is_view": False}
    assert node_forward_s(matmul, hw, "float16") == pytest.approx(matmul["flops"] / (312e12 * 0.6))
    assert node_backward_s(matmul, hw, "float16") == pytest.approx(2 * node_forward_s(matmul, hw, "float16"))
    gelu = {"flops": 0, "input_bytes": 2**30, "output_bytes": 2**30, "is_view": False}
    assert node_forward_s(gelu, hw, "float16") == pytest.approx(2**31 / 2.0e12)
    assert node_forward_s({**gelu, "is_view": True}, hw, "float16") == 0.0


def test_presets_and_unknown_hardware():
    assert set(HARDWARE_PRESETS) == {"a100-80g", "h100-sxm", "h200", "cpu-local", "a100-pcie-box", "a100-25gbe",
                                     "a100-100gbe", "a100-dp-1gbit", "a100-dp-100mbit"}
    with pytest.raises(LynxConfigError, match="a100-80g"):
        get_hardware("tpu-v5")
    spec = HARDWARE_PRESETS["h200"]
    assert get_hardware(spec) is spec
    with pytest.raises(ValueError):
        HardwareSpec(name="x", device="cuda", peak_flops={"float32": 1.0}, achievable_fraction=0.5,
                     memory_bandwidth=1.0, memory_bytes=1, links={"pp": LINK})


def test_measure_mode_times_real_nodes():
    model, inputs = build_preset("gpt-tiny", device="cpu")
    a = analyze(model, inputs, target="cpu", hardware="cpu-local", times="measure")
    G = a.graph
    assert G.graph["time_source"] == "measured"
    linears = [n for n in G if G.nodes[n]["op"] == "aten.linear.default"]
    assert all(G.nodes[n]["forward_s"] > 0 and G.nodes[n]["backward_s"] > 0 for n in linears)


def test_measure_mode_refuses_meta_models():
    model, inputs = build_preset("gpt-tiny", device="meta")
    with pytest.raises(LynxConfigError, match="real weights"):
        analyze(model, inputs, times="measure")


def test_host_overhead_per_generated_op():
    """A node costs op_overhead_s per op its generated forward and backward run where the
    profile counted them; one op each (none for a view's backward) where it did not."""
    hw = HardwareSpec(name="host", device="cpu", peak_flops={"float32": 1e12}, achievable_fraction=1.0,
                      memory_bandwidth=1e12, memory_bytes=2**30, links={k: LINK for k in ("pp", "tp", "dp")},
                      op_overhead_s=1e-6)
    node = {"flops": 0, "input_bytes": 0, "output_bytes": 0, "is_view": False}
    assert node_forward_s(node, hw, "float32") == pytest.approx(1e-6)
    assert node_backward_s(node, hw, "float32") == pytest.approx(1e-6)
    counted = {**node, "forward_ops": 3, "backward_ops": 5}
    assert node_forward_s(counted, hw, "float32") == pytest.approx(3e-6)
    assert node_backward_s(counted, hw, "float32") == pytest.approx(5e-6)
    view = {**node, "is_view": True}
    assert (node_forward_s(view, hw, "float32"), node_backward_s(view, hw, "float32")) == (pytest.approx(1e-6), 0.0)
    assert node_backward_s({**view, "backward_ops": 1}, hw, "float32") == pytest.approx(1e-6)
    folded = {**node, "forward_ops": 0, "backward_ops": 0}  # a node the joint graph folded away
    assert node_forward_s(folded, hw, "float32") == node_backward_s(folded, hw, "float32") == 0.0
