"""Checkpoints of a pipeline × data-parallel run: safetensors and JSON, a manifest, nothing unpickled.

Every rank writes its state — a ``state_dict()`` of nested dicts, lists and tuples of
tensors and plain values — as its own part, ``rank{r}.safetensors`` (the tensors) and
``rank{r}.json`` (the rest; :mod:`lynx.runtime.state_files`). Replicas' optimizer states
differ, so nothing is de-duplicated. Rank 0 adds ``lynx_meta.json`` (the run's configuration:
model and sizes, pp, dp, microbatches, optimizer, plan fingerprint, stage split, step) and,
last, ``manifest.json``: every file with its size and SHA-256. Loading verifies what it reads
against the manifest and parses no format that can carry code, so a checkpoint from elsewhere
is data, never a program; a missing, truncated or altered file is named.

A checkpoint is written into ``.NAME.tmp`` beside its final path and renamed when complete,
so a run killed while writing leaves no half checkpoint behind; an existing one is never
overwritten (a save onto it is an error). A state holding a NaN in a floating-point tensor
(weights or optimizer state a non-finite step ruined; infinities are legitimate in buffers such
as a causal mask) is refused, on every rank, before anything is written. :func:`usable_checkpoint` finds
the newest checkpoint of a directory that verifies, naming the damaged ones above it;
:func:`check_compatible` refuses one made under another configuration (naming the fields).
The directory must be visible to every rank (a shared file system across machines) and used
by one job at a time (:class:`lynx.runtime.checkpoint_lock.CheckpointLock`).

Example (inside an initialised process group, or in one process)::

    save_checkpoint(state, "ckpt", meta={"model": "gpt-tiny", "pp": 2})   # a RankState: ckpt/step_4
    path, damaged = usable_checkpoint("ckpt")      # ckpt/step_4 and [] (or the damaged ones above it)
    check_compatible(read_meta(path), current_meta)
    load_checkpoint(state, path)

    save_state({"pipe": pipe.state_dict(opt), "step": 8}, "run/step_8")   # any state, e.g. a Pipeline's
    state = load_state("run/step_8")                                       # this rank's part
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lynx.errors import LynxCheckpointError
from lynx.runtime import state_files
from lynx.runtime.state_files import MANIFEST

__all__ = ["save_state", "load_state", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "usable_checkpoint", "read_meta", "check_compatible", "META_FILE", "MANIFEST", "COMPARED_FIELDS"]

META_FILE = "lynx_meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# What a resumed run must share with the checkpoint: what every rank's state is made of.
# Step count, learning rate, memory budget and solver may change (plans give bitwise-equal gradients).
COMPARED_FIELDS = ("model", "model_dims", "pp", "dp", "tp", "microbatches", "optimizer", "seed", "stage_layers")
# what a field absent from an older checkpoint's metadata meant
_ABSENT = {"tp": 1}


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (between the job's own live ranks: no checkpoint data)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _part(rank: int) -> str:
    return f"rank{rank}"


# -------------------------------------------------------------------------------- any state
def save_state(state: Any, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write every rank's ``state`` into the checkpoint ``path`` (collective; see module docstring).

    ``meta`` (rank 0's) goes to ``lynx_meta.json``. Refused on every rank, before anything is
    written, when ``path`` exists or some rank's state holds a NaN tensor.
    """
    rank, world = _rank_world()
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    bad = state_files.nan_tensors(state)
    problem = f"rank {rank}'s state holds NaN in {', '.join(bad[:3])}" if bad else None
    if rank == 0 and problem is None and path.exists():
        problem = f"{path} already exists: a checkpoint is never overwritten (choose another directory or step)"
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise _everywhere(f"not writing checkpoint {path}: {'; '.join(problems)}")
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed while writing (the lock is held)
        tmp.mkdir()
    _barrier()
    error = None
    try:
        names = state_files.write_part(tmp, _part(rank), state)
        records: Any = {name: state_files.file_record(tmp, name) for name in names}
    except Exception as err:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
        error, records = f"rank {rank}: {type(err).__name__}: {err}", None
    everyone = _gather((error, records))
    errors = [e for e, _ in everyone if e]
    if errors:
        raise _everywhere(f"writing checkpoint {path} failed: {'; '.join(errors)}")
    if rank == 0:
        files = {name: record for _, part in everyone for name, record in part.items()}
        if meta is not None:
            state_files.write_json(tmp / META_FILE, {"meta": meta})
            files[META_FILE] = state_files.file_record(tmp, META_FILE)
        state_files.write_manifest(tmp, files, world_size=world)  # last: its presence marks completion
        os.rename(tmp, path)   # atomic: the checkpoint appears complete or not at all
        _fsync_dir(path.parent)
    _barrier()
    return path


def _everywhere(message: str) -> LynxCheckpointError:
    """An error every rank raises alike (they compared notes first)."""
    error = LynxCheckpointError(message)
    error.every_rank = True
    return error


def load_state(path: str | Path) -> Any:
    """This rank's part of checkpoint ``path``, verified against its manifest (see module docstring)."""
    rank, world = _rank_world()
    path = Path(path)
    written = state_files.read_manifest(path)["world_size"]
    if written != world:
        raise LynxCheckpointError(f"checkpoint {path} was written by {written} ranks, this job has {world}: "
                                  f"resume with the mesh it was made with")
    return state_files.read_part(path, _part(rank))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------- a run's step_N folders
def save_checkpoint(source: Any, ckpt_dir: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``source.state_dict()`` at step ``source.next_step`` into ``ckpt_dir/step_N`` (collective)."""
    step = source.next_step
    return save_state(source.state_dict(), Path(ckpt_dir) / f"step_{step}", meta=dict(meta, step=step))


def load_checkpoint(target: Any, path: str | Path) -> int:
    """Load this rank's part of checkpoint ``path`` into ``target`` (``load_state_dict``); its step.

    The part's files and the run's configuration (``lynx_meta.json``) are verified first."""
    read_meta(path)
    state = load_state(path)
    if not isinstance(state, dict) or "step" not in state:
        raise LynxCheckpointError(f"checkpoint {path} holds no training state of this kind (no step)")
    target.load_state_dict(state)
    return int(state["step"])


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in ckpt_dir.iterdir() if (m := _STEP_DIR.match(child.name))]
    return sorted(found, reverse=True)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete (manifest written, not yet verified) checkpoint with the highest step, or None."""
    return next((p for _, p in _step_dirs(Path(ckpt_dir)) if (p / MANIFEST).is_file()), None)


def usable_checkpoint(ckpt_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``ckpt_dir`` whose every file verifies and reads, and the
    newer ones that do not, each with the reason (the first file at fault)."""
    damaged: list[tuple[Path, str]] = []
    for _, path in _step_dirs(Path(ckpt_dir)):
        try:
            state_files.verify(path, parse=True)
            return path, damaged
        except LynxCheckpointError as err:
            damaged.append((path, str(err)))
    return None, damaged


def read_meta(path: str | Path) -> dict[str, Any]:
    """The configuration checkpoint ``path`` was written under (verified against its manifest)."""
    path = Path(path)
    state_files.verify(path, [META_FILE])
    data = state_files.read_json(path / META_FILE)
    if not isinstance(data.get("meta"), dict):
        raise LynxCheckpointError(f"{path / META_FILE} holds no run configuration")
    return data["meta"]


def check_compatible(
    saved: dict[str, Any], current: dict[str, Any], where: str = "the checkpoint",
    fields: Sequence[str] = COMPARED_FIELDS,
) -> None:
    """Refuse to resume when the run's configuration differs from the checkpoint's in ``fields``
    (a subset of :data:`COMPARED_FIELDS`: what is known so far, e.g. before planning)."""
    differ = [f"{name}: checkpoint {saved.get(name)!r}, this run {current.get(name)!r}"
              for name in fields
              if saved.get(name, _ABSENT.get(name)) != current.get(name, _ABSENT.get(name))]
    if differ:
        raise LynxCheckpointError(
            f"cannot resume from {where}: it was written by another configuration ({'; '.join(differ)}). "
            f"Run with the checkpoint's settings, or point --checkpoint-dir at an empty directory to start afresh.")
