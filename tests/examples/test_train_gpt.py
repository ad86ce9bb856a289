"""examples/train_gpt.py as torchrun runs it (2 processes, gloo): trains, resumes bitwise, refuses bad input.

Each rank is a plain ``python examples/train_gpt.py`` with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT), so every rank's exit code and stderr can be checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lynx.runtime.topology import free_port
from prestarted import start_rank

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS, EVERY = 6, 2           # checkpoints at steps 2, 4 and 6


def start(args: list[str], world: int = 2, cwd: Path | None = None, fresh: bool = False) -> list[Any]:
    """Start the script on ``world`` ranks with torchrun's environment (the fixed cpu-local
    preset unless ``args`` choose the hardware or a plan: ``auto`` would measure this machine).
    Each rank is forked from a process that has imported torch and Lynx (tests/prestarted.py:
    ~4 s of CPU less per rank), or with ``fresh`` a new interpreter, as torchrun starts it."""
    if "--hardware" not in args and "--plan" not in args:
        args = [*args, "--hardware", "cpu-local"]
    port = free_port()
    procs: list[Any] = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        if fresh:
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, cwd=cwd,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        else:
            procs.append(start_rank(SCRIPT, args, env, cwd))
    return procs


def launch(
    args: list[str], world: int = 2, cwd: Path | None = None, timeout: float = 150.0, fresh: bool = False
) -> list[tuple[int, str, str]]:
    """Run the script on ``world`` ranks; (exit code, stdout, stderr) per rank."""
    return launch_many([args], world, cwd, timeout, fresh)[0]


def launch_many(
    runs: list[list[str]], world: int = 2, cwd: Path | None = None, timeout: float = 150.0, fresh: bool = False
) -> list[list[tuple[int, str, str]]]:
    """Several independent runs at once (side by side: one's ranks run while another's wait)."""
    started = [start(args, world, cwd, fresh) for args in runs]
    out = []
    try:
        for procs in started:
            out.append([(p.returncode, *p.communicate(timeout=timeout)) for p in procs])
    finally:
        for procs in started:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return [
        [(p.returncode, stdout, stderr) for p, (_, stdout, stderr) in zip(procs, rows)]
        for procs, rows in zip(started, out)
    ]


def snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the hash of its bytes (to show nothing changed; the
    checkpoint lock's file names its latest holder, so it is left out)."""
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != ".lynx.lock"
    }


def losses(log: Path) -> list[list[float]]:
    return [s["losses"] for s in json.loads(log.read_text())["steps"]]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted run: 6 steps, a checkpoint every 2; its ranks are new interpreters, as
    torchrun starts them (the other launches fork a process that has imported torch and Lynx)."""
    tmp = tmp_path_factory.mktemp("train")
    result = launch(
        [
            "--steps",
            str(STEPS),
            "--checkpoint-dir",
            str(tmp / "ckpt"),
            "--checkpoint-every",
            str(EVERY),
            "--log-json",
            str(tmp / "full.json"),
        ],
        fresh=True,
    )
    assert all(code == 0 for code, _, _ in result), [err[-2000:] for _, _, err in result]
    return tmp, result


def test_training_loss_falls_and_reports_plan_vs_measured(full_run) -> None:
    tmp, result = full_run
    steps = losses(tmp / "full.json")
    assert len(steps) == STEPS and all(len(s) == 4 for s in steps)  # 4 microbatches, 1 replica
    mean = [sum(s) / len(s) for s in steps]
    assert mean[0] > 5.0 and mean[-1] < mean[0] - 0.8, mean  # bytes start at ~ln 256 = 5.55
    stdout = result[0][1]
    assert "step time: measured" in stdout and "predicted" in stdout
    assert "step time: measured" in stdout and "the first (warm-up) left out" in stdout
    for stage in (0, 1):  # byte counts of the real 2-process run: the memory bar holds on every run
        line = next(x for x in stdout.splitlines() if x.startswith(f"stage {stage} peak activations: measured"))
        assert "(within 5%)" in line and "under the activation budget" in line, line
    assert all((tmp / "ckpt" / f"step_{k}" / "manifest.json").is_file() for k in (2, 4, 6))
    # no temporary left; the lock file stays (naming its last holder), the lock itself went with the run
    assert {p.name for p in (tmp / "ckpt").iterdir() if p.name.startswith(".")} == {".lynx.lock"}


def test_killed_run_resumes_bitwise_past_a_damaged_checkpoint_and_refuses_a_second_job(full_run, tmp_path) -> None:
    """A job killed with SIGKILL (possibly mid-save), whose newest checkpoint then loses the end
    of a shard, resumes from the checkpoint before it with bitwise the uninterrupted run's losses
    (issue 22, finding 6: a truncated shard at --resume was a miniz traceback naming no file; now
    it is named, moved aside, and the previous complete checkpoint used). Issue 22, finding 3
    (two jobs on one directory destroyed each other's checkpoints): while the first job holds
    the directory's lock, a second job is refused in one line naming it; the first goes on and
    skips none of its saves. The first is stopped (SIGSTOP) while the second starts, so it cannot
    finish or run past the steps the resume is compared on."""
    from lynx.runtime import state_files

    tmp, _ = full_run
    ckpt = tmp_path / "ckpt"
    # a generous peer timeout: the ranks are paused together while the second job starts
    procs = start(["--steps", "1000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--timeout-s", "900"])
    try:
        deadline = time.monotonic() + 120
        lock = ckpt / ".lynx.lock"
        while '"pid"' not in (lock.read_text() if lock.exists() else ""):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the first job never locked"
            time.sleep(0.1)
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        try:
            second = launch(["--steps", "30", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"])
        finally:
            for p in procs:
                p.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not (ckpt / "step_4" / "lynx_meta.json").exists():   # two checkpoints: one to fall back to
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint written"
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()  # SIGKILL: no clean-up of any kind, possibly in the middle of a save
            p.communicate()
    refused(second, f"is in use by another job (pid {procs[0].pid} on ")
    assert [line for _, _, err in second for line in err.splitlines() if line.strip()] == [
        second[0][2].strip()], "one line, from rank 0"
    saved = sorted(int(p.name.split("_")[1]) for p in ckpt.iterdir() if re.fullmatch(r"step_\d+", p.name))
    assert saved == list(range(2, 2 * len(saved) + 1, 2)), f"the first job skipped a save: {saved}"
    newest = saved[-1]
    shard = ckpt / f"step_{newest}" / "rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    result = launch(["--steps", str(STEPS), "--checkpoint-dir", str(ckpt), "--resume", "--checkpoint-every", str(EVERY),
                     "--log-json", str(tmp_path / "resumed.json")])
    assert all(code == 0 for code, _, _ in result), [err[-2000:] for _, _, err in result]
    assert f"checkpoint step_{newest} is damaged" in result[0][1] and "rank1.safetensors" in result[0][1]
    first = json.loads((tmp_path / "resumed.json").read_text())["start_step"]
    assert first == newest - EVERY and 2 <= first < STEPS, (first, saved)
    assert losses(tmp_path / "resumed.json") == losses(tmp / "full.json")[first:]
    # the damaged one moved aside, not deleted; the resumed run's own last checkpoint verifies
    assert (ckpt / f"step_{newest}.damaged").is_dir() and state_files.verify(ckpt / f"step_{STEPS}", parse=True)


def refused(result: list[tuple[int, str, str]], message: str) -> None:
    """Every rank stopped non-zero before training; rank 0 said why, nobody dumped a traceback."""
    assert all(code != 0 for code, _, _ in result), [code for code, _, _ in result]
    assert message in result[0][2], result[0][2][-2000:]
    for _, stdout, stderr in result:
        assert "Traceback" not in stderr, stderr[-2000:]
        assert "step    1" not in stdout


def test_checkpoint_of_another_configuration_is_refused(full_run, tmp_path) -> None:
    tmp, _ = full_run
    first, second = tmp_path / "a", tmp_path / "b"   # one directory each: a directory takes one job at a time
    shutil.copytree(tmp / "ckpt", first)
    shutil.copytree(tmp / "ckpt", second)
    before = snapshot(first)
    other_config, no_resume = launch_many(
        [
            ["--steps", "8", "--checkpoint-dir", str(first), "--resume", "--optimizer", "lion", "--microbatches", "2"],
            ["--steps", "8", "--checkpoint-dir", str(second), "--checkpoint-every", "2"],
        ],
        cwd=tmp_path,
    )
    refused(other_config, "optimizer: checkpoint 'demo', this run 'lion'")
    refused(no_resume, "pass --resume to continue")
    assert snapshot(first) == before and snapshot(second) == before


class _Payload:
    """Unpickling this creates ``path``: the proof that a reader ran code from a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_damaged_checkpoints_are_named_and_never_run(full_run, tmp_path) -> None:
    """Issue 22, finding 1 and 6: a checkpoint with a payload in every file, or one whose
    manifest was rewritten to match a planted file, stops every rank with one line naming the
    file, and the payload never runs. (A truncated newest shard, which falls back to the previous
    checkpoint, is the killed run's: test_killed_run_resumes_bitwise_past_a_damaged_checkpoint...)"""
    import pickle

    from lynx.runtime import state_files

    tmp, _ = full_run
    marker = tmp_path / "payload-ran"
    planted, matched = tmp_path / "planted", tmp_path / "matched"
    for folder in (planted, matched):   # one checkpoint only: nothing to fall back to
        shutil.copytree(tmp / "ckpt" / "step_2", folder / "step_2")
    for f in (planted / "step_2").iterdir():
        f.write_bytes(pickle.dumps(_Payload(marker)))
    (matched / "step_2" / "rank1.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((matched / "step_2" / "manifest.json").read_text())
    manifest["files"]["rank1.safetensors"] = state_files.file_record(matched / "step_2", "rank1.safetensors")
    (matched / "step_2" / "manifest.json").write_text(json.dumps(manifest))
    resume = ["--steps", str(STEPS), "--resume", "--checkpoint-every", str(EVERY), "--checkpoint-dir"]
    all_files, one_file = launch_many([[*resume, str(planted)], [*resume, str(matched)]], cwd=tmp_path)
    for result, file in ((all_files, "manifest.json"), (one_file, "rank1.safetensors")):
        refused(result, "no checkpoint in ")
        lines = [line for _, _, err in result for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and f"step_2/{file}" in lines[0], lines
    assert not marker.exists()


