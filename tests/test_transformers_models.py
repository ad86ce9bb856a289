"""Models from a library nobody here wrote: transformers, built from a config, no download."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lynx.frontend.analyze import analyze  # noqa: E402


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=4)
    return transformers.GPT2LMHeadModel(cfg), 3


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg), 3


class _Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, labels):
        return self.model(input_ids=idx, labels=labels).loss


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_transformers_models_capture_and_profile(build):
    torch.manual_seed(0)
    model, layers = build()
    idx = torch.randint(0, 128, (2, 16))
    a = analyze(_Loss(model), (idx, idx), target="cpu", hardware="cpu-local")
    G = a.graph
    assert a.profile.total_saved_bytes > 0
    (indices,) = G.graph["layer_classes"].values()
    assert indices == list(range(layers))
