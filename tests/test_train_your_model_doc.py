"""docs/train_your_model.md: the commands of "Run the examples" run as written and train."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from lynx.planner.hardware import HARDWARE_PRESETS
from lynx.planner.hardware_cache import auto_path
from lynx.planner.hardware_files import write_hardware_file

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "train_your_model.md"


def _commands() -> list[str]:
    section = GUIDE.read_text().split("## Run the examples", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_guides_commands_run_as_written(tmp_path, monkeypatch):
    commands = _commands()
    assert len(commands) == 3 and all(c.startswith("torchrun ") for c in commands)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # the scripts plan with --hardware auto: here auto is pinned to the fixed cpu-local figures (a
    # hardware file in this host's cache slot), so the plans are the same on every machine and
    # nothing is measured
    monkeypatch.setenv("LYNX_CACHE_DIR", str(tmp_path / "cache"))
    write_hardware_file(HARDWARE_PRESETS["cpu-local"], auto_path())
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    losses: dict[int, list[float]] = {}
    for i, command in enumerate(commands):
        run = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        losses[i] = [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", run.stdout, re.M)]
        assert "nodes recomputed" in run.stdout and "plan heu" in run.stdout, run.stdout[-2000:]
    assert len(losses[0]) == 6 and losses[0][-1] < losses[0][0]          # trains
    assert len(losses[1]) == 2 and (tmp_path / "ckpt").is_dir()          # resumed at step 7
    assert abs(losses[1][0] - losses[0][-1]) < 1.0
    assert len(losses[2]) == 3
