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


def test_factory_file_imports_its_siblings(tmp_path, monkeypatch):
    """A model split over two files (nanoGPT's model.py beside a factory file) imports as under
    ``python factory.py``: the file's folder is on the import path."""
    pkg = tmp_path / "nano"
    pkg.mkdir()
    (pkg / "nano_model_xyz.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x).square().mean()\n")
    (pkg / "factory_xyz.py").write_text(
        "import torch\n"
        "from nano_model_xyz import Net\n"
        "def make():\n"
        "    return Net(), torch.randn(2, 4)\n"
        "def make_keywords():\n"
        "    return Net(), {'x': torch.randn(2, 4)}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))   # restored after the test
    resolved = resolve_model("nano/factory_xyz.py:make")
    assert type(resolved.model).__name__ == "Net" and len(resolved.example_inputs) == 1
    assert list(resolve_model("nano/factory_xyz.py:make_keywords").example_inputs) == ["x"]


@pytest.mark.parametrize("returned,shown", [
    ("torch.zeros(2, 3)", "it returned a Tensor(2, 3) float32"),
    ("(torch.nn.Linear(2, 2),)", "it returned a tuple of 1: (a Linear module)"),
    ("(torch.nn.Linear(2, 2), 'inputs')", "it returned a tuple of 2: (a Linear module, str 'inputs')"),
    ("(torch.zeros(2), torch.nn.Linear(2, 2))", "it returned a tuple of 2: (a Tensor(2,) float32, a Linear module)"),
])
def test_factory_returning_something_else_is_shown(tmp_path, monkeypatch, returned, shown):
    (tmp_path / "bad_factory_xyz.py").write_text(f"import torch\ndef make():\n    return {returned}\n")
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    with pytest.raises(LynxConfigError, match="must return \\(model, example_inputs\\)") as err:
        resolve_model(f"{tmp_path / 'bad_factory_xyz.py'}:make")
    assert shown in str(err.value)
