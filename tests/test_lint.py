"""ruff (configured in pyproject.toml: line length 120, pycodestyle and pyflakes) finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "lynx", "tests", "benchmarks", "examples"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in run.stderr, "ruff is in the dev extra: pip install -e '.[dev]'"
    assert run.returncode == 0, run.stdout + run.stderr
