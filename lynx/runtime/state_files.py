"""A state as files that cannot carry code: tensors in safetensors, the rest in JSON, a manifest.

A checkpoint is input from elsewhere: a file that unpickles runs whatever it was made to run
(``torch.load(weights_only=False)``, the ``pickle.load`` of a ``torch.distributed.checkpoint``
``.metadata``). Nothing here unpickles. A state — nested dicts, lists and tuples of tensors,
numbers, strings, booleans and None, e.g. a ``state_dict()`` — is written as one part of two
files: ``NAME.safetensors`` (every tensor: a JSON header and raw bytes, checked for bounds by
the ``safetensors`` library) and ``NAME.json`` (the structure, each tensor by its key). A
directory's ``manifest.json`` lists every file with its size and SHA-256; :func:`verify`
checks them and names the first file that is missing, truncated, altered or does not parse.

Example::

    >>> import tempfile, torch
    >>> folder = tempfile.mkdtemp()
    >>> state = {"model": {"w": torch.ones(2)}, "step": 3, "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}
    >>> files = write_part(folder, "rank0", state)
    >>> write_manifest(folder, {f: file_record(folder, f) for f in files}, world_size=1)
    >>> _ = verify(folder)
    >>> again = read_part(folder, "rank0")
    >>> again["step"], again["groups"][0]["betas"], torch.equal(again["model"]["w"], state["model"]["w"])
    (3, (0.9, 0.95), True)
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from lynx import json_files
from lynx.errors import LynxCheckpointError

__all__ = ["MANIFEST", "FORMAT", "write_part", "read_part", "part_files", "file_record", "write_manifest",
           "read_manifest", "verify", "encode", "decode", "nan_tensors", "write_json", "read_json"]

MANIFEST = "manifest.json"
FORMAT = "lynx-checkpoint"
VERSION = 1
_CHUNK = 1 << 20


def part_files(name: str) -> tuple[str, str]:
    """The two files of part ``name``: its tensors and its structure."""
    return f"{name}.safetensors", f"{name}.json"


# ------------------------------------------------------------------------------- encoding
def encode(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` as a JSON-ready tree and its tensors by key (every non-JSON value tagged)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"float": repr(value)}
        if isinstance(value, torch.Tensor):
            return {"tensor": _add_tensor(value, path, tensors, storages)}
        if isinstance(value, dict):
            return {"dict": [[walk(k, (*path, "key")), walk(v, (*path, str(k)))] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [walk(v, (*path, str(i))) for i, v in enumerate(value)]}
        raise LynxCheckpointError(
            f"cannot write {'/'.join(path) or 'the state'} ({type(value).__name__}) into a checkpoint: a state holds "
            f"tensors, numbers, strings, booleans, None, and dicts, lists and tuples of them")

    return walk(state, ()), tensors


def _add_tensor(t: torch.Tensor, path: tuple[str, ...], tensors: dict[str, torch.Tensor], storages: set[int]) -> str:
    if t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise LynxCheckpointError(f"cannot write {'/'.join(path)}: a {type(t).__name__} with layout {t.layout} "
                                  f"(a checkpoint holds plain dense tensors)")
    t = t.detach().cpu()
    storage = t.untyped_storage()
    whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
    if not whole or storage.data_ptr() in storages:  # a view, or memory another entry shares: its own copy
        t = t.clone(memory_format=torch.contiguous_format)
    storages.add(t.untyped_storage().data_ptr())
    key = "/".join(path) or "tensor"
    while key in tensors:  # "a/b" as one key and as a nested path: keep both
        key += "~"
    tensors[key] = t
    return key


def decode(tree: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The inverse of :func:`encode`; anything else in ``tree`` is an error naming ``where``."""
    used: set[str] = set()

    def walk(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, dict) and len(node) == 1:
            (kind, body), = node.items()
            if kind == "tensor" and isinstance(body, str) and body in tensors:
                used.add(body)
                return tensors[body]
            if kind == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
            if kind in ("list", "tuple") and isinstance(body, list):
                items = [walk(v) for v in body]
                return items if kind == "list" else tuple(items)
            if kind == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
                return {walk(k): walk(v) for k, v in body}
        raise LynxCheckpointError(f"{where} is corrupt: it holds {str(node)[:80]!r}, which this Lynx never writes")

    state = walk(tree)
    unused = sorted(set(tensors) - used)
    if unused:
        raise LynxCheckpointError(f"{where} does not name the tensors {unused[:3]} its .safetensors file holds: "
                                  f"the two files of the part come from different checkpoints")
    return state


def nan_tensors(state: Any, path: str = "") -> list[str]:
    """Where ``state`` holds a floating-point tensor with a NaN: weights or optimizer state a
    non-finite step ruined. (Infinities are legitimate in buffers — a causal mask's ``-inf`` —
    and a plain float such as a scheduler's ``best = inf`` is not a tensor.)"""
    found: list[str] = []
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel() and bool(torch.isnan(state).any()):
            found.append(path or "the tensor")
    elif isinstance(state, dict):
        for key, value in state.items():
            found += nan_tensors(value, f"{path}/{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            found += nan_tensors(value, f"{path}/{i}" if path else str(i))
    return found


# ---------------------------------------------------------------------------------- files
def write_part(directory: str | os.PathLike, name: str, state: Any) -> list[str]:
    """Write ``state`` as part ``name`` of ``directory``; returns the two file names."""
    from safetensors.torch import save_file

    tree, tensors = encode(state)
    tensor_file, tree_file = part_files(name)
    directory = Path(directory)
    save_file(tensors, str(directory / tensor_file))
    write_json(directory / tree_file, {"state": tree})
    return [tensor_file, tree_file]


def read_part(directory: str | os.PathLike, name: str) -> Any:
    """Part ``name`` of ``directory`` (its files verified against the manifest first)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    tensor_file, tree_file = part_files(name)
    verify(directory, [tensor_file, tree_file])
    try:
        tensors = load_file(str(directory / tensor_file), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise LynxCheckpointError(f"{directory / tensor_file} does not read as safetensors: {err}") from None
    data = read_json(directory / tree_file)
    return decode(data.get("state"), tensors, str(directory / tree_file))


def file_record(directory: str | os.PathLike, name: str) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of file ``name`` in ``directory``."""
    digest = hashlib.sha256()
    size = 0
    with open(Path(directory) / name, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def write_manifest(directory: str | os.PathLike, files: dict[str, dict[str, Any]], *, world_size: int) -> None:
    """List ``files`` (name → :func:`file_record`) in ``directory/manifest.json``."""
    write_json(Path(directory) / MANIFEST, {"world_size": world_size, "files": dict(sorted(files.items()))})


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of ``directory``, checked for form (a damaged one is named)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise LynxCheckpointError(f"{directory} has no {MANIFEST}: not a complete Lynx checkpoint (an older Lynx "
                                  f"wrote torch.distributed.checkpoint files, which are not read: they unpickle)")
    data = read_json(path)
    files = data.get("files")
    if (data.get("version") != VERSION or not isinstance(files, dict) or not isinstance(data.get("world_size"), int)
            or not all(isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
                       for r in files.values())):
        raise LynxCheckpointError(f"{path} is not a manifest this Lynx writes (version {VERSION}: world_size and "
                                  f"a size and sha256 per file)")
    for name in files:
        if Path(name).name != name or name in (MANIFEST, "", ".", ".."):
            raise LynxCheckpointError(f"{path} lists {name!r}, which is not a file of the checkpoint's own folder")
    return data


def verify(directory: str | os.PathLike, names: list[str] | None = None, *, parse: bool = False) -> dict[str, Any]:
    """Check ``names`` (default: every file the manifest lists) against their size and SHA-256,
    and with ``parse`` that each reads (safetensors header, JSON); returns the manifest.

    Raises :class:`LynxCheckpointError` naming the first file that fails.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    files = manifest["files"]
    for name in names if names is not None else sorted(files):
        path = directory / name
        if name not in files:
            raise LynxCheckpointError(f"{path} is not listed in {directory / MANIFEST}: the checkpoint is incomplete")
        expected = files[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise LynxCheckpointError(f"{path} is missing (the manifest lists it, {expected['size']} bytes)") from None
        if size != expected["size"]:
            raise LynxCheckpointError(f"{path} is {size} bytes, the manifest says {expected['size']}: "
                                      f"{'truncated' if size < expected['size'] else 'altered'}")
        if file_record(directory, name)["sha256"] != expected["sha256"]:
            raise LynxCheckpointError(f"{path} does not match its SHA-256 in the manifest: the file was altered")
        if parse:
            _parse(path)
    return manifest


def _parse(path: Path) -> None:
    """That ``path`` reads as what its name says (headers only for safetensors)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except (SafetensorError, OSError, ValueError) as err:
            raise LynxCheckpointError(f"{path} does not read as safetensors: {err}") from None
    elif path.suffix == ".json":
        read_json(path)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file :func:`write_json` wrote (strict JSON; another file is named and refused)."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise LynxCheckpointError(f"cannot read {path}: {err}") from None
    data = json_files.loads(raw, str(path), error=LynxCheckpointError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LynxCheckpointError(f"{path} is not a file this Lynx writes (no \"format\": {FORMAT!r})")
    return data


def write_json(path: Path, body: dict[str, Any]) -> None:
    """``body`` with this format's tag as a JSON file, flushed to disk."""
    text = json_files.dumps({"format": FORMAT, "version": VERSION, **body})
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
