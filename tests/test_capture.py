import pytest
import torch

from lynx.frontend.capture import capture
from lynx.errors import LynxCaptureError
from lynx.models import build_preset


def test_export_shares_original_parameters_and_matches_model():
    model, inputs = build_preset("gpt-tiny", device="cpu")
    captured = capture(model, inputs)
    assert captured.method == "export" and captured.folded is None
    assert captured.gm.get_submodule("layers.0.attn.qkv").weight is model.layers[0].attn.qkv.weight
    torch.manual_seed(0)
    expected = model(*inputs)
    torch.manual_seed(0)
    assert torch.equal(captured.gm(*inputs), expected)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.lin(x)
        return x


def test_data_dependent_control_flow_names_file_and_line():
    with pytest.raises(LynxCaptureError) as err:
        capture(Branchy(), (torch.randn(2, 4),))
    text = str(err.value)
    assert "test_capture.py" in text and "data-dependent" in text and "torch.where" in text


def test_symbolic_trace_fallback_when_export_fails(monkeypatch):
    def broken_export(*args, **kwargs):
        raise RuntimeError("export unavailable")

    monkeypatch.setattr(torch.export, "export", broken_export)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    captured = capture(model, (x,))
    assert captured.method == "symbolic_trace" and "export unavailable" in captured.export_error
    assert torch.equal(captured.gm(x), model(x))


def test_wrong_input_shape_is_a_clear_error():
    model, _ = build_preset("gpt-tiny", device="meta")
    bad = torch.zeros(2, 3, 32, dtype=torch.long, device="meta")
    with pytest.raises(LynxCaptureError, match=r"\(2, 3, 32\)"):
        capture(model, (bad, bad))


def test_non_tensor_inputs_and_non_modules_are_refused():
    with pytest.raises(LynxCaptureError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))
    with pytest.raises(LynxCaptureError, match="tensors"):
        capture(torch.nn.Linear(2, 2), ("not a tensor",))


def test_deep_meta_models_are_folded():
    model, inputs = build_preset("gpt-1.3b", device="meta")
    captured = capture(model, inputs)
    assert captured.folded is not None and captured.folded.total == 24
    assert len(model.layers) == 24  # the model itself is restored


class KeyValueCache:   # a result type torch.export cannot flatten (as transformers' DynamicCache)
    def __init__(self, value):
        self.value = value


class ReturnsCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, KeyValueCache(y)


def test_an_output_export_cannot_flatten_names_the_type_and_the_cache_fix():
    with pytest.raises(LynxCaptureError) as err:
        capture(ReturnsCache(), (torch.randn(2, 4),))
    text = str(err.value)
    assert "KeyValueCache" in text and "cannot flatten" in text and "use_cache = False" in text
