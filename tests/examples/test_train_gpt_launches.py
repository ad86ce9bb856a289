"""examples/train_gpt.py launched afresh per test (2 processes, gloo, torchrun's environment):
refusals of a mesh, budget or plan; non-finite losses; a TP plan from the CLI (the refusal of a
second job on a checkpoint directory runs beside the killed run, in test_train_gpt.py).

The launches and checks are tests/examples/test_train_gpt.py's (that file holds the tests sharing
one uninterrupted run); split so the two halves run side by side.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_train_gpt import refused, launch, launch_many, losses, snapshot


def test_more_processes_than_the_mesh_is_refused(tmp_path) -> None:
    refused(
        launch(["--steps", "2", "--pp", "2", "--dp", "1"], world=3, cwd=tmp_path),
        "3 processes were started but the mesh is pp 2 × dp 1 = 2",
    )


def test_budget_no_plan_meets_is_refused_on_every_rank(tmp_path) -> None:
    log = tmp_path / "log.json"
    log.write_text("{}")
    refused(
        launch(["--steps", "2", "--memory-budget", "2MiB", "--log-json", str(log)], cwd=tmp_path),
        "no heu plan fits memory_budget 2.00 MiB",
    )
    assert log.read_text() == "{}"


def test_plan_for_another_mesh_or_model_is_refused(tmp_path) -> None:
    import lynx

    model, inputs = lynx.models.build_preset("gpt-tiny", seq=64, microbatch=8)
    plan = lynx.compile(
        model,
        inputs,
        pp=2,
        dp=2,
        microbatches=4,
        memory_budget="12MiB",
        hardware="cpu-local",
        optimizer="demo",
        solver="heu",
    ).plan
    plan.save(tmp_path / "dp2.json")
    before = snapshot(tmp_path)
    other_mesh, other_model = launch_many(
        [
            ["--steps", "2", "--plan", str(tmp_path / "dp2.json"), "--dp", "1"],
            ["--steps", "2", "--plan", str(tmp_path / "dp2.json"), "--seq", "32", "--dp", "1"],
        ],
        cwd=tmp_path,
    )
    refused(other_mesh, "differs in dp: plan 2, now 1")
    refused(other_model, "differs in the model graph")
    assert snapshot(tmp_path) == before


def _strict_json(path: Path) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"{path} holds {token}: not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_non_finite_loss_stops_every_rank_or_is_skipped(tmp_path) -> None:
    """Issue 22, finding 2: --lr 1e6 took the loss to nan at step 3 and trained on, checkpointing
    NaN weights and writing bare NaN into --log-json."""
    from lynx.runtime import state_files

    common = ["--steps", "5", "--lr", "1e6", "--optimizer", "adamw", "--checkpoint-every", "1"]
    stopped, skipped = launch_many(
        [[*common, "--checkpoint-dir", str(tmp_path / "a"), "--log-json", str(tmp_path / "a.json")],
         [*common, "--checkpoint-dir", str(tmp_path / "b"), "--log-json", str(tmp_path / "b.json"),
          "--skip-nonfinite"]], cwd=tmp_path)
    assert all(code != 0 for code, _, _ in stopped)
    lines = [line for _, _, err in stopped for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "non-finite values in step " in lines[0], lines
    assert "rank 1 (stage 1, replica 0): loss" in lines[0], lines
    first = int(lines[0].split("non-finite values in step ")[1].split()[0])
    log = _strict_json(tmp_path / "a.json")
    assert [s["step"] for s in log["steps"]] == list(range(first - 1))
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.name.startswith("step_")) == [
        f"step_{k}" for k in range(1, first)]
    assert all(code == 0 for code, _, _ in skipped), [err[-2000:] for _, _, err in skipped]
    log = _strict_json(tmp_path / "b.json")
    assert [s["step"] for s in log["skipped_steps"]] == list(range(first - 1, 5))
    assert f"skipped {6 - first} step(s) with a non-finite loss or gradient" in skipped[0][1]
    for folder in (tmp_path / "a", tmp_path / "b"):   # what was saved is finite, every rank's part
        for step in (p for p in folder.iterdir() if p.name.startswith("step_")):
            for rank in (0, 1):
                part = state_files.read_part(step, f"rank{rank}")
                assert state_files.nan_tensors(part) == [], (step, rank)


def test_a_tp_plan_from_the_cli_trains_and_resumes_bitwise(tmp_path) -> None:
    """``lynx plan ... --tp 2 -o plan.json`` then train_gpt.py --plan: pp 1 × tp 2 on 2 processes, a
    checkpoint per TP shard, and a run resumed from it continues with bitwise the same losses."""
    from typer.testing import CliRunner

    from lynx.cli import app

    plan = tmp_path / "tp.json"
    made = CliRunner().invoke(app, ["plan", "gpt-tiny", "--seq", "32", "--microbatch", "2", "--pp", "1", "--tp", "2",
                                    "-m", "2", "--optimizer", "adamw", "--hardware", "cpu-local", "-b", "2.8MiB",
                                    "-o", str(plan)])
    assert made.exit_code == 0, made.output
    assert json.loads(plan.read_text())["config"]["tp_plan"]["layers.*.attn.qkv"] == "colwise:3"
    common = ["--plan", str(plan), "--seq", "32", "--microbatch", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    full = launch([*common, "--steps", "4", "--checkpoint-every", "2", "--log-json", str(tmp_path / "full.json")])
    assert all(code == 0 for code, _, _ in full), [err[-2000:] for _, _, err in full]
    assert "pp 1 × dp 1 × tp 2" in full[0][1] and " tp " in full[0][1]   # the banner and the per-rank table
    shutil.rmtree(tmp_path / "ckpt" / "step_4")
    resumed = launch([*common, "--steps", "4", "--resume", "--log-json", str(tmp_path / "resumed.json")])
    assert all(code == 0 for code, _, _ in resumed), [err[-2000:] for _, _, err in resumed]
    assert json.loads((tmp_path / "resumed.json").read_text())["start_step"] == 2
    assert losses(tmp_path / "resumed.json") == losses(tmp_path / "full.json")[2:]
