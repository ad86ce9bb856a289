"""The host costs of a CPU run in the cost model: random numbers, the eager op overhead (views
included: generated code dispatches them) and the optimizer step; zero on the GPU presets."""

from __future__ import annotations

import pytest

from lynx.planner.cost import node_backward_s, node_forward_s, optimizer_step_s
from lynx.planner.hardware import HARDWARE_PRESETS, get_hardware

_DROPOUT = {"op": "aten.dropout.default", "flops": 0, "input_bytes": 4096, "output_bytes": 4096,
            "is_view": False, "output_shapes": [(8, 128)]}
_ADD = dict(_DROPOUT, op="aten.add.Tensor")
_VIEW = {"op": "aten.view.default", "flops": 0, "input_bytes": 0, "output_bytes": 0, "is_view": True}


def test_gpu_presets_model_no_host_costs() -> None:
    for name, hw in HARDWARE_PRESETS.items():
        if hw.device != "cuda":
            continue
        assert hw.rng_s_per_element == hw.op_overhead_s == 0.0, name
        assert optimizer_step_s(10**9, "adamw", hw) == 0.0
        assert node_forward_s(_DROPOUT, hw, "float16") == node_forward_s(_ADD, hw, "float16")
        assert node_forward_s(_VIEW, hw, "float16") == 0.0


def test_cpu_local_random_ops_pay_per_element_and_every_node_pays_the_op_overhead() -> None:
    hw = get_hardware("cpu-local")
    extra = node_forward_s(_DROPOUT, hw, "float32") - node_forward_s(_ADD, hw, "float32")
    assert extra == pytest.approx(8 * 128 * hw.rng_s_per_element)
    assert node_forward_s(_VIEW, hw, "float32") == hw.op_overhead_s > 0
    assert not hasattr(hw, "interpreter_node_s")                  # stages run generated code
    assert node_backward_s(_VIEW, hw, "float32") == 0.0          # autograd runs views' backward in C++
    assert node_backward_s(_DROPOUT, hw, "float32") == node_backward_s(_ADD, hw, "float32")


@pytest.mark.parametrize("optimizer", ["adamw", "demo", "lion"])
def test_cpu_local_optimizer_step_is_linear_in_parameters(optimizer: str) -> None:
    hw = get_hardware("cpu-local")
    one = optimizer_step_s(100_000, optimizer, hw)
    assert one > 0
    assert optimizer_step_s(200_000, optimizer, hw) == pytest.approx(2 * one)
    assert optimizer_step_s(100_000, "unknown", hw) == 0.0
