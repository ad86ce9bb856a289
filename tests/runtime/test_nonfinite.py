"""``lynx.runtime.nonfinite.flag``: 1 exactly when some gradient element is NaN or ±inf."""

import math

import pytest
import torch

from lynx.runtime import nonfinite


@pytest.mark.parametrize("bad", [float("nan"), math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_non_finite_element_raises_the_flag(bad: float, dtype: torch.dtype) -> None:
    grads = [torch.ones(5, 3, dtype=dtype), torch.zeros(0), torch.tensor([1.0, bad, -2.0], dtype=dtype)]
    assert nonfinite.flag(grads).item() == 1.0


def test_large_finite_gradients_do_not_raise_it() -> None:
    # a 2-norm of these would overflow to inf; the flag looks at elements, not at a norm
    grads = [torch.full((1000,), 3e38), torch.full((4,), -3e38)]
    assert nonfinite.flag(grads).item() == 0.0
    assert nonfinite.flag([]).item() == 0.0 and nonfinite.flag([torch.zeros(0)]).item() == 0.0
