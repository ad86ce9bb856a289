"""Checkpoints of a pipeline × data-parallel run through ``torch.distributed.checkpoint``.

Every rank writes its :meth:`~lynx.runtime.rank_state.RankState.state_dict` under keys of its
own, ``s{stage}d{dp_rank}/...`` (replicas' optimizer states differ, so nothing is
de-duplicated): the stage's parameters and buffers and the optimizer's state tensors as
tensors, the rest (step, param groups, RNG states) as one small object. Rank 0 adds
``lynx_meta.json`` with the run's configuration (model and sizes, pp, dp, microbatches,
optimizer, plan fingerprint, stage split, step).

A checkpoint is written into ``ckpt_dir/.step_N.tmp`` and renamed to ``ckpt_dir/step_N``
once complete, so a run killed while writing leaves no half checkpoint behind and
:func:`latest_checkpoint` only sees complete ones; an existing ``step_N`` is never
overwritten. :func:`check_compatible` refuses a checkpoint made under another configuration
(naming the fields) before anything trains. The checkpoint directory must be visible to
every rank (a shared file system across machines).

Example (inside an initialised process group)::

    save_checkpoint(trainer, "ckpt", meta={"model": "gpt-tiny", "pp": 2})
    path = latest_checkpoint("ckpt")            # ckpt/step_4, or None
    check_compatible(read_meta(path), current_meta)
    load_checkpoint(trainer, path)
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxConfigError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_meta", "check_compatible",
           "META_FILE", "COMPARED_FIELDS"]

META_FILE = "lynx_meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# What a resumed run must share with the checkpoint: what every rank's state is made of.
# Step count, learning rate, memory budget and solver may change (plans give bitwise-equal gradients).
COMPARED_FIELDS = ("model", "model_dims", "pp", "dp", "microbatches", "optimizer", "seed", "stage_layers")


def _prefix(trainer: Any) -> str:
    return f"s{trainer.topo.stage}d{trainer.topo.dp_rank}"


def _flatten(trainer: Any) -> dict[str, Any]:
    """Rank-unique keys: tensors as tensors, everything else in one ``.../extra`` object."""
    state, p = trainer.state_dict(), _prefix(trainer)
    flat: dict[str, Any] = {f"{p}/model/{name}": t.detach() for name, t in state["model"].items()}
    extra: dict[str, Any] = {"step": state["step"], "rng": state["rng"], "optimizer": None}
    opt = state["optimizer"]
    if opt is not None:
        scalars: dict[str, dict[str, Any]] = {}
        for pid, entries in opt["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat[f"{p}/optim/{pid}/{key}"] = value
                else:
                    scalars.setdefault(str(pid), {})[key] = value
        extra["optimizer"] = {"param_groups": opt["param_groups"], "scalars": scalars,
                              "tensor_ids": sorted({str(pid) for pid in opt["state"]})}
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    flat[f"{p}/extra"] = buffer.getvalue()  # bytes: one object (a dict would be flattened into keys)
    return flat


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(trainer: Any, ckpt_dir: str | Path, meta: dict[str, Any]) -> Path | None:
    """Write ``trainer``'s state at its next step into ``ckpt_dir/step_N`` (collective).

    Returns the path, or None when ``step_N`` already exists (left untouched: never overwritten).
    """
    import torch.distributed.checkpoint as dcp

    ckpt_dir = Path(ckpt_dir)
    step = trainer.next_step
    final, tmp = ckpt_dir / f"step_{step}", ckpt_dir / f".step_{step}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    exists = False
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        exists = final.exists()
        if not exists:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed while writing
            tmp.mkdir()
    if _broadcast(exists):
        return None
    _barrier()
    dcp.save(_flatten(trainer), storage_writer=dcp.FileSystemWriter(str(tmp)))
    _barrier()
    if rank == 0:
        record = dict(meta, step=step)
        with open(tmp / META_FILE, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)   # atomic: the checkpoint appears complete or not at all
        _fsync_dir(ckpt_dir)
    _barrier()
    return final


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


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``ckpt_dir``, or None."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    found = []
    for child in ckpt_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_FILE).is_file() and (child / ".metadata").is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    """The configuration a checkpoint was written under."""
    path = Path(path)
    try:
        return json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise LynxConfigError(f"{path} is not a complete Lynx checkpoint: no {META_FILE}") from None
    except (OSError, ValueError) as err:
        raise LynxConfigError(f"cannot read {path / META_FILE}: {err}") from None


def check_compatible(saved: dict[str, Any], current: dict[str, Any], where: str = "the checkpoint") -> None:
    """Refuse to resume when the run's configuration differs from the checkpoint's."""
    differ = [f"{name}: checkpoint {saved.get(name)!r}, this run {current.get(name)!r}"
              for name in COMPARED_FIELDS if saved.get(name) != current.get(name)]
    if differ:
        raise LynxConfigError(
            f"cannot resume from {where}: it was written by another configuration ({'; '.join(differ)}). "
            f"Run with the checkpoint's settings, or point --checkpoint-dir at an empty directory to start afresh.")


def load_checkpoint(trainer: Any, path: str | Path) -> int:
    """Load this rank's part of checkpoint ``path`` into ``trainer`` (collective); returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path, p = Path(path), _prefix(trainer)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if f"{p}/extra" not in metadata:
        raise LynxConfigError(f"checkpoint {path} holds no state for stage {trainer.topo.stage}, "
                              f"replica {trainer.topo.dp_rank}: it was written by another mesh")
    flat: dict[str, Any] = {}
    for key, item in metadata.items():
        if not key.startswith(p + "/") or key == f"{p}/extra":
            continue
        if not isinstance(item, TensorStorageMetadata):
            continue
        name = key[len(p) + 1:]
        if name.startswith("model/") and name[len("model/"):] in trainer.tensors:
            flat[key] = trainer.tensors[name[len("model/"):]].detach()  # loaded in place
        else:
            flat[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    missing = sorted(set(trainer.tensors) - {k[len(p) + 7:] for k in flat if k.startswith(f"{p}/model/")})
    if missing:
        raise LynxConfigError(f"checkpoint {path} lacks stage {trainer.topo.stage}'s tensors {missing[:4]}: "
                              f"it was written for another model or split")
    flat[f"{p}/extra"] = None  # replaced by the stored object
    dcp.load(flat, storage_reader=dcp.FileSystemReader(str(path)))
    extra = torch.load(io.BytesIO(flat[f"{p}/extra"]), weights_only=False)
    optimizer = None
    if extra["optimizer"] is not None:
        per_param: dict[int, dict[str, Any]] = {}
        for key, value in flat.items():
            if key.startswith(f"{p}/optim/"):
                pid, name = key[len(p) + 7:].split("/", 1)
                per_param.setdefault(int(pid), {})[name] = value
        for pid, scalars in extra["optimizer"]["scalars"].items():
            per_param.setdefault(int(pid), {}).update(scalars)
        optimizer = {"state": per_param, "param_groups": extra["optimizer"]["param_groups"]}
    trainer.load_state_dict({"model": {k[len(p) + 7:]: v for k, v in flat.items() if k.startswith(f"{p}/model/")},
                             "optimizer": optimizer, "step": extra["step"], "rng": extra["rng"]})
    return int(extra["step"])
