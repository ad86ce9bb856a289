"""Built-in model presets with published sizes, and the resolver for ``MODEL`` arguments.

A ``MODEL`` is a preset name (``gpt-1.3b`` … ``gpt-20b``, ``llama-7b``, ``gpt-tiny``,
``llama-tiny``) or a ``module:factory`` import path whose factory returns
``(model, example_inputs)``. Presets build on the meta device by default, so a 20B model is
described without allocating its weights.

Example::

    >>> from lynx.models import resolve_model
    >>> m = resolve_model("gpt-20b", seq=2048, microbatch=1)
    >>> m.dims["hidden"], m.dims["layers"], next(m.model.parameters()).device.type
    (6144, 44, 'meta')
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import nn

from lynx.errors import LynxConfigError
from lynx.models.gpt import GPT, Attention, GPTConfig
from lynx.models.llama import Llama, LlamaConfig

__all__ = ["PRESETS", "Preset", "ResolvedModel", "build_preset", "check_factory_result", "infer_dims", "resolve_model",
           "parse_dtype"]


@dataclass(frozen=True)
class Preset:
    name: str
    family: str  # "gpt" | "llama"
    config: GPTConfig | LlamaConfig
    dtype: torch.dtype
    published: str  # where the sizes come from


def _gpt(name: str, hidden: int, layers: int, heads: int, source: str) -> Preset:
    cfg = GPTConfig(vocab_size=51200, seq_len=2048, hidden=hidden, heads=heads, layers=layers)
    return Preset(name, "gpt", cfg, torch.float16, source)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _gpt("gpt-1.3b", 2048, 24, 16, "GPT-3 XL / Megatron-LM 1.3B"),
        _gpt("gpt-2.7b", 2560, 32, 20, "GPT-3 2.7B"),
        _gpt("gpt-6.7b", 4096, 32, 32, "GPT-3 6.7B"),
        _gpt("gpt-13b", 5120, 40, 40, "GPT-3 13B"),
        _gpt("gpt-20b", 6144, 44, 64, "GPT-NeoX-20B"),
        Preset("llama-7b", "llama", LlamaConfig(), torch.float16, "Llama 2 7B"),
        Preset(
            "gpt-tiny", "gpt",
            GPTConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=4), torch.float32, "test size",
        ),
        Preset(
            "llama-tiny", "llama",
            LlamaConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, kv_heads=2, layers=4, ffn_hidden=172),
            torch.float32, "test size",
        ),
    ]
}

_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise LynxConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LynxConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass
class ResolvedModel:
    """A model ready to capture: the module, one microbatch of inputs, and what is known of it."""

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...] | dict[str, torch.Tensor]   # dict: passed by keyword
    dims: dict[str, Any] = field(default_factory=dict)


def build_preset(
    name: str,
    *,
    seq: int | None = None,
    microbatch: int | None = None,
    dtype: str | torch.dtype | None = None,
    attention: str | None = None,
    dropout: float | None = None,
    device: str | torch.device = "meta",
) -> tuple[nn.Module, tuple[torch.Tensor, ...] | dict[str, torch.Tensor]]:
    """Build preset ``name`` as ``(model, (idx, targets))`` for one microbatch."""
    m = resolve_model(name, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention,
                      dropout=dropout, device=device)
    return m.model, m.example_inputs


def _build(preset: Preset, seq: int | None, microbatch: int, dtype: torch.dtype, attention: str | None,
           dropout: float | None, device: torch.device) -> ResolvedModel:
    cfg = preset.config
    if seq is not None:
        cfg = replace(cfg, seq_len=seq)
    if attention is not None:
        if preset.family != "gpt":
            raise LynxConfigError(f"--attention applies to GPT presets only; {preset.name} always uses sdpa")
        if attention not in ("math", "sdpa"):
            raise LynxConfigError(f"attention must be 'math' or 'sdpa', got {attention!r}")
        assert isinstance(cfg, GPTConfig)   # a "gpt" preset holds a GPTConfig
        cfg = replace(cfg, attention=cast(Attention, attention))   # one of them: checked above
    if dropout is not None:
        if preset.family != "gpt":
            raise LynxConfigError(f"dropout applies to GPT presets only, not {preset.name}")
        assert isinstance(cfg, GPTConfig)   # a "gpt" preset holds a GPTConfig
        cfg = replace(cfg, dropout=dropout)
    with torch.device(device):
        model = (GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)).to(dtype)   # family "gpt": GPTConfig
        idx = torch.zeros(microbatch, cfg.seq_len, dtype=torch.long)  # (B, T)
        if device.type != "meta":
            gen = torch.Generator().manual_seed(0)
            idx = torch.randint(0, cfg.vocab_size, (microbatch, cfg.seq_len), generator=gen).to(device)
    dims = {"hidden": cfg.hidden, "heads": cfg.heads, "layers": cfg.layers, "seq": cfg.seq_len,
            "microbatch": microbatch, "dtype": str(dtype).removeprefix("torch.")}
    return ResolvedModel(preset.name, model, (idx, idx.roll(-1, dims=1)), dims)


def _load_factory(spec: str) -> Callable[[], Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise LynxConfigError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor 'module:factory'")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.exists():
                raise LynxConfigError(f"factory file {path} does not exist")
            folder = str(path.resolve().parent)   # its sibling modules import as in `python file.py`
            if folder not in sys.path:
                sys.path.insert(0, folder)
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
            sys.modules[path.stem] = module
            mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise LynxConfigError(f"cannot import {module_name!r} for MODEL {spec!r}: {err}. "
                              "Check the module is on PYTHONPATH (or pass a file path).") from err
    except LynxConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's module failed while loading: say where, in one line
        raise LynxConfigError(f"loading {module_name!r} for MODEL {spec!r} raised {_where(err)}") from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise LynxConfigError(f"{module_name!r} has no callable {attr!r} (MODEL {spec!r})")
    return factory


def _where(err: BaseException) -> str:
    """``Kind: message (at file:line)``: the innermost frame, where the user's code raised."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(err, SyntaxError) and err.filename:
        at = f" (at {err.filename}:{err.lineno})"
    return f"{type(err).__name__}: {err}{at}"


def _call_factory(spec: str) -> Any:
    """The factory's result; an exception inside it is one line naming it and where it raised."""
    factory = _load_factory(spec)
    try:
        return factory()
    except Exception as err:  # noqa: BLE001 - the user's code: say what and where, not 50 lines
        raise LynxConfigError(f"the model factory {spec!r} raised {_where(err)}; run it on its own to see the "
                              f"whole traceback") from err


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: (" + ", ".join(_shown(v) for v in value[:4]) + ")"
    if isinstance(value, dict):
        return "a dict {" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in list(value.items())[:4]) + "}"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__} module"
    return f"{type(value).__name__} {value!r}"[:120]


def check_factory_result(spec: str, produced: Any) -> tuple[nn.Module, tuple | dict]:
    """``(model, example_inputs)`` from what factory ``spec`` returned, or an error showing it.

    ``example_inputs`` is one microbatch: a tensor, a tuple or list of tensors (positional), or
    a dict of tensors (by keyword).
    """
    ok_pair = isinstance(produced, (tuple, list)) and len(produced) == 2 and isinstance(produced[0], nn.Module)
    if ok_pair:
        inputs = produced[1]
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        values = list(inputs.values()) if isinstance(inputs, dict) else inputs
        if isinstance(values, (tuple, list)) and values and all(isinstance(t, torch.Tensor) for t in values):
            return produced[0], (dict(inputs) if isinstance(inputs, dict) else tuple(inputs))
    raise LynxConfigError(
        f"factory {spec!r} must return (model, example_inputs) — an nn.Module and one microbatch of inputs "
        f"(a tensor, a tuple of tensors, or a dict of tensors by keyword) — but it returned {_shown(produced)}")


def infer_dims(model: nn.Module, inputs: tuple) -> dict[str, Any]:
    """What a model reveals of its sizes (``None`` where it does not): from its config and inputs."""
    cfg = getattr(model, "config", None)

    def first_attr(*names: str) -> Any:
        return next((getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)), None)

    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    params = list(model.parameters())
    return {
        "hidden": first_attr("hidden", "hidden_size", "n_embd", "d_model"),
        "heads": first_attr("heads", "num_attention_heads", "n_head"),
        "layers": first_attr("layers", "num_hidden_layers", "n_layer"),
        "seq": first.shape[1] if first is not None and first.dim() >= 2 else None,
        "microbatch": first.shape[0] if first is not None and first.dim() >= 1 else None,
        "dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
    }


def resolve_model(
    spec: str,
    *,
    seq: int | None = None,
    microbatch: int | None = None,
    dtype: str | torch.dtype | None = None,
    attention: str | None = None,
    dropout: float | None = None,
    device: str | torch.device = "meta",
) -> ResolvedModel:
    """Turn a ``MODEL`` argument (preset or ``module:factory``) into a :class:`ResolvedModel`."""
    if seq is not None:
        _positive_int("seq", seq)
    if microbatch is not None:
        _positive_int("microbatch", microbatch)
    torch_dtype = parse_dtype(dtype)
    if spec in PRESETS:
        preset = PRESETS[spec]
        return _build(preset, seq, microbatch or 1, torch_dtype or preset.dtype, attention, dropout,
                      torch.device(device))
    if ":" not in spec:
        raise LynxConfigError(f"unknown model preset {spec!r}; valid presets: {', '.join(PRESETS)} "
                              "(or pass 'module:factory' returning (model, example_inputs))")
    produced = _call_factory(spec)
    model, inputs = check_factory_result(spec, produced)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    dims = infer_dims(model, tuple(inputs.values()) if isinstance(inputs, dict) else inputs)
    return ResolvedModel(spec, model, inputs, dims)
