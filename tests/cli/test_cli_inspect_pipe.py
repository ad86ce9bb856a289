"""`lynx inspect` piped to a file or another program keeps wide table columns whole
(rich would otherwise assume 80 columns and cut them)."""

from __future__ import annotations

import os
import subprocess
import sys

LONG = "AVeryLongDescriptiveTransformerBlockClassNameThatWouldNotFitInEightyColumns"

FACTORY = f"""
import torch


class {LONG}(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


def build():
    return torch.nn.Sequential(*[{LONG}() for _ in range(3)]), (torch.randn(4, 8),)
"""


def test_inspect_table_through_a_pipe_is_not_truncated(tmp_path) -> None:
    (tmp_path / "long_factory.py").write_text(FACTORY)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", "from lynx.cli import main; main()", "inspect", "long_factory:build",
         "--hardware", "cpu-local"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert LONG in result.stdout, result.stdout  # one line, whole
    assert "…" not in result.stdout, result.stdout
