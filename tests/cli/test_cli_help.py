"""Every command, option and argument of the `lynx` CLI has help text (it feeds --help and docs/cli.md)."""

from __future__ import annotations

import typer

from lynx.cli import app


def _commands():
    stack = [("lynx", typer.main.get_command(app))]
    while stack:
        path, command = stack.pop()
        yield path, command
        stack.extend((f"{path} {name}", sub) for name, sub in getattr(command, "commands", {}).items())


def test_every_command_option_and_argument_has_help() -> None:
    missing = []
    for path, command in _commands():
        if not (command.help or "").strip():
            missing.append(f"{path} (the command)")
        for param in command.params:
            if not getattr(param, "hidden", False) and not (getattr(param, "help", None) or "").strip():
                missing.append(f"{path} {'/'.join(param.opts)}")
    assert not missing, "add help= to: " + ", ".join(missing)
