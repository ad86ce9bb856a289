"""Static checks: ruff over every committed Python file, mypy over the packages it passes.

ruff is configured in pyproject.toml (line length 120, pycodestyle and pyflakes); mypy too
(``[tool.mypy]``: all of ``lynx/`` but the modules its ``exclude`` lists, each a debt to pay).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _committed_python() -> list[str]:
    """Every ``.py`` file git tracks (what a clone has); the whole tree where there is no git."""
    listed = subprocess.run(["git", "ls-files", "--", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = listed.stdout.split()
    return files if listed.returncode == 0 and files else ["."]


def test_ruff_finds_nothing() -> None:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", *_committed_python()]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in run.stderr, "ruff is in the dev extra: pip install -e '.[dev]'"
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_finds_nothing() -> None:
    cache = Path(tempfile.gettempdir()) / "lynx-mypy-cache"  # incremental: later runs check what changed
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(cache)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named mypy" not in run.stderr, "mypy is in the dev extra: pip install -e '.[dev]'"
    assert run.returncode == 0, run.stdout + run.stderr
