"""docs/train_your_model.md: the commands of "Run the examples" run as written and train.

Each command is parsed by torchrun's own argument parser (``torch.distributed.run``), so a
torchrun option the guide misspells fails here as it would for a reader; its script and the
script's arguments then run as written on ``--nproc_per_node`` ranks with the environment
torchrun gives a rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT`` of a
standalone rendezvous). The ranks fork from the suite's fork server, which has imported torch
and Lynx (tests/prestarted.py): a fresh torchrun and its ranks would spend ~4-5 CPU-s
each importing them, three launches ~40 CPU-s of a 2-core suite. Starting a script's ranks
under real torchrun is tests/examples/test_train_gpt.py's ``full_run``.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from lynx.planner.hardware import HARDWARE_PRESETS
from lynx.planner.hardware_cache import auto_path
from lynx.planner.hardware_files import write_hardware_file
from prestarted import run_world, start_world

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "train_your_model.md"


def _commands() -> list[str]:
    section = GUIDE.read_text().split("## Run the examples", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def _torchrun(command: str, cwd: Path, env: dict[str, str]) -> list[tuple[int, str, str]]:
    """``command`` (``torchrun ...``) as torchrun would run it on this host: (exit code, stdout,
    stderr) per rank."""
    from torch.distributed.run import get_args_parser

    argv = shlex.split(command)
    assert argv[0] == "torchrun", command
    args = get_args_parser().parse_args(argv[1:])   # exits (SystemExit 2) on an option torchrun lacks
    assert args.standalone and args.nnodes in ("1", "1:1") and not (args.module or args.no_python), command
    return run_world(start_world(cwd / args.training_script, args.training_script_args, int(args.nproc_per_node),
                                 env, cwd), timeout=300)


def test_the_guides_commands_run_as_written(tmp_path, monkeypatch):
    commands = _commands()
    assert len(commands) == 3 and all(c.startswith("torchrun ") for c in commands)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # the scripts plan with --hardware auto: here auto is pinned to the fixed cpu-local figures (a
    # hardware file in this host's cache slot), so the plans are the same on every machine and
    # nothing is measured
    monkeypatch.setenv("LYNX_CACHE_DIR", str(tmp_path / "cache"))
    write_hardware_file(HARDWARE_PRESETS["cpu-local"], auto_path())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    losses: dict[int, list[float]] = {}
    for i, command in enumerate(commands):
        ranks = _torchrun(command, tmp_path, env)
        stdout = "".join(out for _, out, _ in ranks)
        assert all(code == 0 for code, _, _ in ranks), f"{command}\n{stdout[-2000:]}\n" + "\n".join(
            err[-3000:] for _, _, err in ranks)
        losses[i] = [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", stdout, re.M)]
        assert "nodes recomputed" in stdout and "plan heu" in stdout, stdout[-2000:]
    assert len(losses[0]) == 6 and losses[0][-1] < losses[0][0]          # trains
    assert len(losses[1]) == 2 and (tmp_path / "ckpt").is_dir()          # resumed at step 7
    assert abs(losses[1][0] - losses[0][-1]) < 1.0
    assert len(losses[2]) == 3
