"""The model zoo: Megatron-style GPT, Llama-style decoder, presets with published sizes.

Example::

    >>> from lynx.models import build_preset
    >>> model, (idx, targets) = build_preset("gpt-tiny", device="cpu")
    >>> float(model(idx, targets)) > 0
    True
"""

from lynx.models.gpt import GPT, GPTBlock, GPTConfig
from lynx.models.llama import Llama, LlamaBlock, LlamaConfig
from lynx.models.presets import PRESETS, Preset, ResolvedModel, build_preset, infer_dims, parse_dtype, resolve_model

__all__ = [
    "GPT", "GPTBlock", "GPTConfig", "Llama", "LlamaBlock", "LlamaConfig",
    "PRESETS", "Preset", "ResolvedModel", "build_preset", "infer_dims", "parse_dtype", "resolve_model",
]
