"""lynx.runtime.Pipeline under torchrun: a user's own loop trains like single-process PyTorch.

Models nobody here wrote the runtime for — a plain ``nn.Module`` returning ``(logits, loss)``,
the same with attention (a plain GPT), a ``transformers`` Llama from a config
(``.loss``; eager attention: the sdpa path runs another program under torch.export, see
tests/test_transformers_models.py) — and Lynx's gpt-tiny are compiled with an HEU plan that
recomputes, trained 3 steps with AdamW from the user's loop with torchrun's environment (2
processes: pp 2; and 4 processes, pp 2 × dp 2, in tests/runtime/test_runtime_pipeline.py's spawned world:
:data:`DP_CASES`) under 1F1B, interleaved 1F1B (2 chunks per rank) and ZB-H1
(each backward split into its input- and weight-gradient graphs, lowered from one joint graph,
the weight part deferred) — and, pp 2 × dp 2, gpt-tiny under a plan that offloads to host
memory (copied after the forward, brought back in windows or inside the backward graph) —
and compared with single-process PyTorch on the same batches
(:func:`user_models.reference`): per-step losses, first-step gradients and final parameters
**bitwise** equal (same ops in the same order: microbatch losses scaled by 1/m and each
parameter's gradient accumulated in microbatch order — a parameter belongs to one chunk,
whose backward, or weight-gradient part, runs the microbatches in order —, replicas'
gradients summed then halved, the loss the float32 mean of the microbatch losses in order; one
thread per process on both sides). The trace shows each rank ran its schedule's action list, and
each rank's measured peak saved bytes is the plan's prediction (within 5% for gpt-tiny). The
pp 2 world also stops and resumes a run with dropout through ``pipe.state_dict``
(:func:`_check_dropout_resume`). The failure path is tests/runtime/test_user_pipeline_failures.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import user_models as um  # noqa: E402
from prestarted import run_world, start_rank, start_world  # noqa: E402


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (a free local port: sessions never collide) with one thread each."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


SCHEDULES = ("interleaved1f1b", "zbh1")


# pp 2 × dp 2: gpt-tiny interleaved (data parallelism over a rank's two chunks, whose gradients
# become final in different actions) and under 1F1B with a plan that offloads. The replicas'
# reduction does not depend on the model (every parameter's gradient is summed then halved), so
# pp 2 × dp 2 does not repeat the models pp 2 trains. They run in the pp 2 × dp 2 world of
# tests/runtime/test_runtime_pipeline.py (pipeline_ranks.train_then_fail), checked there by
# :func:`check_cases`: a world of 4 ranks of its own cost ~25 CPU-s of start-up.
DP_CASES = ("gpt-tiny:interleaved1f1b", "gpt-tiny:1f1b+offload")


def _cases() -> list[str]:
    """pp 2: the plain module under 1F1B, and gpt-tiny, Llama and the plain GPT under each of
    interleaved 1F1B and ZB-H1 (each case is a compilation on both ranks, ~5-10 CPU-s). What
    each covers: ``tuple`` 1F1B (the action list both others extend) with a ``(logits, loss)``
    output; ``gpt-tiny`` a scalar loss and the memory prediction within 5%; ``llama``
    ``transformers``' eager attention (bitwise), keyword inputs and a ``.loss`` attribute; ``gpt``
    a plain module with attention. Qwen2 (eager) ran here too until it was seen to add no path
    Llama does not take (the same transformers attention, keyword inputs and ``.loss``; its
    q/k/v biases are linears with bias, as ``gpt``'s)."""
    try:
        import transformers  # noqa: F401
        hf = True
    except ImportError:
        hf = False
    return ["tuple:1f1b"] + [
        f"{k}:{s}" for k in ("gpt-tiny", "llama", "gpt") if hf or k != "llama" for s in SCHEDULES] + [
        "dropout:resume"]   # _check_dropout_resume's: sharing the world saves a launch


def test_user_loop_matches_single_process_pytorch(tmp_path):
    # the worker script's ranks with torchrun's environment, forked from the suite's fork server
    # (tests/prestarted.py: ~4-5 CPU-s less per rank than a fresh torchrun and its interpreters)
    cases = _cases()
    ranks = run_world(start_world(HERE / "user_pipeline_worker.py", [str(tmp_path), "2", *cases], 2,
                                  dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")), timeout=600)
    assert all(code == 0 for code, _, _ in ranks), "\n".join(out[-3000:] + err[-3000:] for _, out, err in ranks)
    check_cases(tmp_path, cases, nproc=2, pp=2)


def check_cases(out: Path, cases, *, nproc: int, pp: int) -> None:
    """What each rank of a world of ``nproc`` wrote for ``cases`` (user_pipeline_worker.run_cases)
    against single-process PyTorch (module docstring)."""
    dp = nproc // pp
    for case in cases:
        if case == "dropout:resume":
            _check_dropout_resume(out)
            continue
        kind, schedule = case.split(":")
        losses, grads, params = um.reference(kind, dp)
        seen: set[str] = set()
        for rank in range(nproc):
            got = torch.load(out / f"{kind}.{schedule}.rank{rank}.pt", weights_only=False)
            where = f"{kind} {schedule} rank {rank}"
            if schedule.endswith("+offload"):
                assert got["offloaded"] > 0, f"{where}: the plan offloads nothing"
                if got["stage"] == 0:   # the stage holding more than one microbatch moved them
                    assert all(st.offloaded_bytes > 0 for st in got["stats"]), where
            else:
                assert got["recomputed"] > 0, f"{where}: the plan recomputes nothing"
            assert got["form"] == {"tuple": "tuple", "gpt": "tuple", "gpt-tiny": "scalar"}.get(kind, "attribute")
            assert got["losses"] == losses, f"{where}: {got['losses']} vs PyTorch {losses}"
            for name, grad in got["grads"].items():
                assert torch.equal(grad, grads[name]), f"{where}: gradient of {name} differs"
            for name, value in got["params"].items():
                assert torch.equal(value, params[name]), f"{where}: parameter {name} differs"
            # each chunk lowered when the Pipeline was built (lynx.runtime.prelower), for what the steps brought
            once = [1] * len(got["chunks"])
            assert got["lowered"] == (once, once), f"{where}: lowered for (built, after) {got['lowered']} signatures"
            seen |= set(got["params"])
            _check_trace(got, schedule, pp)
            _check_peak(got, kind, where)
        assert seen == set(params), f"{case}: parameters trained by no stage: {sorted(set(params) - seen)}"


def _check_dropout_resume(out: Path) -> None:
    """Issue 22, finding 8: ``Pipeline`` owns each rank's random stream (``lynx.runtime.rank_rng``)
    and its ``state_dict`` carries it: nanoGPT-style training with dropout 0.1 under pp 2 (a plan
    that recomputes the dropouts), stopped after 3 of 6 steps and resumed in a fresh pipe from
    the checkpoint, gives the uninterrupted run's losses exactly (same ops in the same order; one
    thread per process). See dropout_resume_worker.py."""
    for rank in (0, 1):
        got = json.loads((out / f"dropout.resume.rank{rank}.json").read_text())
        assert len(got["full"]) == 6 and got["resumed"] == got["full"], got
        assert len(set(got["full"])) == 6   # the loss moves: the steps really trained


def _check_trace(got: dict, schedule: str, pp: int) -> None:
    """The traced compute actions are the schedule's, in its order; per-chunk memory is measured."""
    from lynx.planner.schedule import stage_actions

    stats = got["stats"][-1]
    schedule = schedule.removesuffix("+offload")
    virtual = 2 if schedule == "interleaved1f1b" else 1
    expected = [(a.kind, a.chunk, a.microbatch) for a in stage_actions(
        schedule, stage=got["stage"], stages=pp, microbatches=um.MICROBATCHES, virtual=virtual)]
    traced = []
    for what, j, _t0, _t1 in stats.events:
        op, _, chunk = what.partition(".c")
        if op in ("F", "B", "I", "W"):
            traced.append((op, int(chunk) if chunk else got["stage"], j))
    assert traced == expected
    if virtual > 1:
        assert got["chunks"] == [got["stage"], got["stage"] + pp]
        assert set(stats.peak_saved_bytes_by_chunk) == set(got["chunks"])
        assert stats.peak_saved_bytes >= max(stats.peak_saved_bytes_by_chunk.values()) > 0


def _check_peak(got: dict, kind: str, where: str) -> None:
    """Each rank's measured peak saved bytes (every step: the same) against the plan's: within 5%
    for gpt-tiny (the planner's replay of the rank's actions, chunks and deferred weight
    gradients included: lynx.solvers.memory_replay); never more than 5% above it for the others."""
    predicted = got["predicted_activation_bytes"]
    for step, stats in enumerate(got["stats"]):
        ratio = stats.peak_saved_bytes / predicted
        at = f"{where} step {step}: measured {stats.peak_saved_bytes} B, plan {predicted} B"
        assert ratio <= 1.05, at
        if kind == "gpt-tiny":
            assert ratio >= 0.95, at


def test_plain_python_is_a_world_of_one_and_loss_fn_takes_the_target(tmp_path):
    """No torchrun: pp × dp = 1 makes its own group; ``loss_fn(logits, target)`` with ``target=``
    split like the inputs; equal to PyTorch accumulating the same microbatches (bitwise)."""
    out = tmp_path / "one.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # ``python user_world_of_one.py OUT``, forked from the suite's fork server (tests/prestarted.py)
    run = start_rank(HERE / "user_world_of_one.py", [str(out)], dict(env, OMP_NUM_THREADS="1"))
    _, err = run.communicate(timeout=240)
    assert run.returncode == 0, err[-3000:]
    got = torch.load(out)
    assert got["world"] == 1
    # issue 22, finding 6: torch's "IndexError: index out of range in self", "has 1 rows along dim 0"
    assert got["refused"]["vocabulary"].startswith(
        f"step() input 'idx' holds {int(um.batches(1)[0][0, 0]) + um.VOCAB} at [0, 0], outside the vocabulary "
        f"0..{um.VOCAB - 1} of embedding emb.weight"), got["refused"]
    assert f"step() input 'idx' is (1, {um.MICROBATCHES * um.MICRO}, {um.SEQ}) (3 dimensions) but the model was " \
           f"compiled for ({um.MICRO}, {um.SEQ}) per microbatch" in got["refused"]["3-D"], got["refused"]
    sys.path.insert(0, str(HERE))
    from user_world_of_one import LogitsOnly, loss_fn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = LogitsOnly()
        opt = um.optimizer(model.parameters())
        losses = []
        for window in um.batches(1):
            mb = []
            for j in range(um.MICROBATCHES):
                rows = slice(j * um.MICRO, (j + 1) * um.MICRO)
                loss = loss_fn(model(window[rows, :-1].contiguous()), window[rows, 1:].contiguous())
                mb.append(loss.detach())
                (loss * (1.0 / um.MICROBATCHES)).backward()
            losses.append(float(torch.stack(mb).mean()))
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    assert got["losses"] == losses
    for name, value in model.named_parameters():
        assert torch.equal(got["params"][name], value.detach()), name
