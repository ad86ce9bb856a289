"""The examples run: custom_model.py's whole path, and the training flags the quickstart documents."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    path = ROOT / "examples" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    spec = importlib.util.spec_from_file_location(f"lynx_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_custom_model_capture_failure_names_the_line_and_the_fix() -> None:
    example = _load("custom_model")
    message = example.show_capture_failure()
    assert "custom_model.py" in message and "h.abs().max() > 10" in message
    assert "torch.where" in message


def test_custom_model_plan_recomputes_and_its_stages_match_the_model_bitwise(capsys) -> None:
    example = _load("custom_model")
    plan = example.plan_and_check(*example.make_model())  # raises if any gradient differs
    assert plan.predicted.fits_budget
    assert any(d.action == "recompute" for d in plan.stages[0].decisions)
    assert "bitwise equal" in capsys.readouterr().out


def test_custom_model_factory_resolves_as_a_cli_model_spec() -> None:
    from lynx.models import resolve_model

    resolved = resolve_model(f"{ROOT / 'examples' / 'custom_model.py'}:make_model")
    assert type(resolved.model).__name__ == "TinyLM" and len(resolved.example_inputs) == 2


def test_every_train_gpt_flag_is_in_the_quickstart(monkeypatch) -> None:
    example = _load("train_gpt")
    captured: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):  # record the parser, parse nothing
        captured.append(self)
        return original(self, [], namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    example.parse_args([])
    flags = [opt for action in captured[0]._actions for opt in action.option_strings
             if opt.startswith("--") and opt != "--help"]
    text = (ROOT / "docs" / "quickstart.md").read_text()
    missing = [flag for flag in flags if f"`{flag}`" not in text]
    assert not missing, f"docs/quickstart.md does not describe examples/train_gpt.py flag(s) {missing}"
