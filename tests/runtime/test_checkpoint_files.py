"""Checkpoints are data, never programs: planted payloads run nothing, damage is named, one job per directory.

A checkpoint of a small model with AdamW state and RNG streams is written in this process
(a world of one, no process group). Then every file of it in turn is replaced by a pickle
whose unpickling would create a marker file — once with the manifest left as it was (the
size and SHA-256 check names the file) and once with the manifest rewritten to match (the
formats themselves refuse it, naming the file). The marker never appears. A truncated file
is named and :func:`usable_checkpoint` falls back to the previous checkpoint.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lynx.errors import LynxCheckpointError
from lynx.runtime import state_files
from lynx.runtime.checkpoint import (
    MANIFEST,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    save_state,
    usable_checkpoint,
)
from lynx.runtime.checkpoint_lock import CheckpointLock
from lynx.runtime.rank_rng import RankRNG
from lynx.runtime.rank_state import RankState


class _Payload:
    """Unpickling this creates ``path``: the proof that a reader ran code from the file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state(seed: int) -> RankState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    rng = RankRNG(seed=seed, stage=0, replica=0, device=torch.device("cpu"))
    return RankState(dict(model.named_parameters()), opt, topo=None, next_step=1, rng=rng)


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    state = _state(0)
    save_checkpoint(state, tmp_path / "ckpt", meta={"model": "mlp"})         # step_1
    state.next_step = 2
    return save_checkpoint(state, tmp_path / "ckpt", meta={"model": "mlp"})  # step_2


def test_round_trip_restores_weights_optimizer_and_stream(checkpoint: Path) -> None:
    saved = _state(0)
    saved.next_step = 2
    fresh = _state(1)
    assert load_checkpoint(fresh, checkpoint) == 2 and read_meta(checkpoint) == {"model": "mlp", "step": 2}
    for name, t in saved.tensors.items():
        assert torch.equal(fresh.tensors[name], t)
    a, b = saved.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    assert torch.equal(fresh.rng.state_dict()["cpu"], saved.rng.state_dict()["cpu"])
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "lynx_meta.json", MANIFEST, "rank0.json", "rank0.safetensors"]


@pytest.mark.parametrize("fix_manifest", [False, True], ids=["manifest-as-written", "manifest-rewritten"])
def test_a_payload_in_any_file_runs_nothing_and_the_error_names_it(checkpoint: Path, tmp_path: Path,
                                                                 fix_manifest: bool) -> None:
    marker = tmp_path / "payload-ran"
    as_pickle = pickle.dumps(_Payload(marker))
    buffer = io.BytesIO()
    torch.save({"x": _Payload(marker)}, buffer)      # what torch.load(weights_only=False) would run
    for name in sorted(p.name for p in checkpoint.iterdir()):
        for payload in (as_pickle, buffer.getvalue()):
            planted = tmp_path / f"planted-{name}"
            shutil.rmtree(planted, ignore_errors=True)
            shutil.copytree(checkpoint, planted)
            (planted / name).write_bytes(payload)
            if fix_manifest and name != MANIFEST:   # an attacker who rewrites the manifest too
                manifest = json.loads((planted / MANIFEST).read_text())
                manifest["files"][name] = state_files.file_record(planted, name)
                (planted / MANIFEST).write_text(json.dumps(manifest))
            with pytest.raises(LynxCheckpointError) as err:
                load_checkpoint(_state(1), planted)
            assert str(planted / name) in str(err.value), (name, str(err.value))
            assert "\n" not in str(err.value)
            with pytest.raises(LynxCheckpointError, match=name.replace(".", r"\.")):
                state_files.verify(planted, parse=True)    # what --resume checks on rank 0
            assert not marker.exists(), f"reading {name} ran the planted code"


def test_truncated_file_is_named_and_the_previous_checkpoint_is_used(checkpoint: Path) -> None:
    part = checkpoint / "rank0.safetensors"
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(LynxCheckpointError, match=r"rank0\.safetensors is \d+ bytes, the manifest says \d+: truncated"):
        load_checkpoint(_state(1), checkpoint)
    usable, damaged = usable_checkpoint(checkpoint.parent)
    assert usable == checkpoint.parent / "step_1"
    assert [p for p, _ in damaged] == [checkpoint] and "rank0.safetensors" in damaged[0][1]


def test_non_finite_state_is_never_written(tmp_path: Path) -> None:
    state = _state(0)
    with torch.no_grad():
        state.tensors["1.bias"][0] = float("nan")
    with pytest.raises(LynxCheckpointError, match=r"rank 0's state holds NaN in model/1\.bias"):
        save_checkpoint(state, tmp_path, meta={})
    assert list(tmp_path.iterdir()) == []


def test_save_state_takes_any_state_and_refuses_what_it_cannot_store(tmp_path: Path) -> None:
    from lynx.runtime.checkpoint import load_state

    state = {"pipe": {"model": {"w": torch.arange(6.0).view(2, 3)[:, 1:]}, "steps": 4},
             "extra": [1, 2.5, None, "s", (True, float("inf"))], 7: "int key"}
    again = load_state(save_state(state, tmp_path / "s"))
    assert again["extra"] == [1, 2.5, None, "s", (True, float("inf"))] and again[7] == "int key"
    assert torch.equal(again["pipe"]["model"]["w"], state["pipe"]["model"]["w"])
    with pytest.raises(LynxCheckpointError, match="cannot write x/y \\(set\\)"):
        save_state({"x": {"y": {1, 2}}}, tmp_path / "t")


_HOLD = """
import sys, time
from lynx.runtime.checkpoint_lock import CheckpointLock
lock = CheckpointLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_job_is_refused_naming_the_holder_and_the_lock_dies_with_it(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LynxCheckpointError, match=rf"in use by another job \(pid {holder.pid} on "):
            CheckpointLock(tmp_path).acquire()
    finally:
        holder.kill()    # SIGKILL: no clean-up; the operating system drops the lock
        holder.wait()
    with CheckpointLock(tmp_path) as lock:
        assert lock.held
