"""docs/cli.md is generated from the CLI; it must equal a fresh rendering (it cannot drift)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("lynx_gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_committed_cli_reference_matches_the_cli() -> None:
    gen = _generator()
    expected = gen.render()
    committed = gen.DOC_PATH.read_text() if gen.DOC_PATH.exists() else ""
    assert committed == expected, "docs/cli.md is out of date with the CLI: run python scripts/gen_cli_docs.py"


def test_reference_names_every_command_and_option() -> None:
    import typer

    from lynx.cli import app

    text = _generator().render()
    root = typer.main.get_command(app)
    stack = [("lynx", root)]
    while stack:
        path, command = stack.pop()
        for name, sub in getattr(command, "commands", {}).items():
            assert f"## `{path} {name}`" in text
            for param in sub.params:
                for opt in param.opts if param.param_type_name == "option" else ():
                    assert f"`{opt}`" in text, (path, name, opt)
            stack.append((f"{path} {name}", sub))
