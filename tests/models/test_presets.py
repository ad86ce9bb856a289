import pytest

from lynx.errors import LynxConfigError
from lynx.models import PRESETS, build_preset, resolve_model

BIG = ["gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-20b", "llama-7b"]
PUBLISHED = {"gpt-1.3b": (2048, 24), "gpt-2.7b": (2560, 32), "gpt-6.7b": (4096, 32),
             "gpt-13b": (5120, 40), "gpt-20b": (6144, 44), "llama-7b": (4096, 32)}


@pytest.mark.parametrize("name", BIG)
def test_presets_build_on_meta_with_published_sizes(name):
    m = resolve_model(name)
    assert all(p.is_meta for p in m.model.parameters())
    assert (m.dims["hidden"], m.dims["layers"]) == PUBLISHED[name]
    assert m.example_inputs[0].shape == (1, m.dims["seq"])


def test_llama_7b_parameter_count_is_published():
    m = resolve_model("llama-7b")
    n = sum(p.numel() for p in m.model.parameters())
    assert 6.6e9 < n < 6.9e9  # Llama 2 7B: 6.74B


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tiny_models_train_on_cpu(name):
    model, inputs = build_preset(name, device="cpu")
    loss = model(*inputs)
    loss.backward()
    assert loss.ndim == 0 and all(p.grad is not None for p in model.parameters())


def test_llama_tiny_uses_grouped_query_attention():
    model, _ = build_preset("llama-tiny", device="meta")
    attn = model.layers[0].attn
    assert attn.kv_heads < attn.heads


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(LynxConfigError) as err:
        resolve_model("gpt-7b")
    for name in PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize("kwargs", [{"seq": -1}, {"seq": 0}, {"microbatch": 2.5}, {"microbatch": True}])
def test_bad_sizes_are_refused(kwargs):
    with pytest.raises(LynxConfigError, match="positive integer"):
        resolve_model("gpt-tiny", **kwargs)


def test_factory_path(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "    return m, (torch.randn(2, 4),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    m = resolve_model("my_models:make")
    assert m.dims["microbatch"] == 2
    with pytest.raises(LynxConfigError, match="no callable"):
        resolve_model("my_models:missing")
    with pytest.raises(LynxConfigError, match="cannot import"):
        resolve_model("no_such_module_xyz:make")
