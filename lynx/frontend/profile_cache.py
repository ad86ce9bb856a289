"""A profile computed once per captured graph: every rank of a job on one host, and every later
run of the same model, reads it from the cache folder instead of tracing the joint graph again.

:func:`lynx.frontend.profile.profile` is a pure function of the captured graph, the shapes of
its parameters and inputs, the target, and the torch and Lynx code that run it (fake tensors:
nothing measured). Those make the key (:func:`profile_key`); a hit is the same
:class:`~lynx.frontend.profile.Profile`, field for field. Tracing the joint graph to count what
the compiled stages save is about half of ``lynx.compile``'s analysis, and a job's ranks all
capture and profile the same model.

Ranks that find no file take a lock file per key in turn: the first profiles, the others read
what it wrote. The file is JSON (nothing in it can run code), written atomically; one that does
not parse or does not match its key is profiled again and replaced. Captures by ``symbolic_trace`` (whose
``call_module`` nodes run code the key cannot see) are never cached. The folder is
:func:`lynx.planner.hardware_cache.cache_dir`'s ``profiles/``, the newest
:data:`KEEP` files kept; ``LYNX_PROFILE_CACHE=0`` turns the cache off.

Example::

    >>> from lynx.frontend.capture import capture
    >>> from lynx.frontend.profile_cache import profile_key
    >>> from lynx.models import build_preset
    >>> model, inputs = build_preset("gpt-tiny", device="meta")
    >>> key = profile_key(capture(model, inputs), "cpu")
    >>> len(key), key == profile_key(capture(model, inputs), "cuda")
    (64, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx

from lynx.frontend.capture import Captured
from lynx.frontend.profile import NodeProfile, Profile, profile

__all__ = ["cached_profile", "profile_key", "profile_cache_dir", "KEEP", "FORMAT"]

KEEP = 64        # newest profile files kept in the folder
FORMAT = 1       # of the file; another value is a miss


def profile_cache_dir() -> Path | None:
    """The folder profiles are cached in; None when ``LYNX_PROFILE_CACHE=0``."""
    if os.environ.get("LYNX_PROFILE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from lynx.planner.hardware_cache import cache_dir

    return cache_dir() / "profiles"


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """Lynx's own sources and torch's build: a profile made by other code is another profile."""
    h = hashlib.sha256(f"torch {torch.__version__} {torch.version.git_version}".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _tensor_meta(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)}/{tuple(t.stride())}/{t.dtype}/{t.requires_grad}"


def profile_key(captured: Captured, target: str) -> str | None:
    """The cache key of ``profile(captured, target)``; None when it cannot be cached."""
    gm = captured.gm
    if captured.method != "export":
        return None
    h = hashlib.sha256(f"{FORMAT} {_code_digest()} {target}".encode())
    for name, module in gm.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        if any(n.op == "call_module" and n.target != "_guards_fn" for n in module.graph.nodes):
            return None   # a submodule's forward runs code the graph does not show
        h.update(f"\n# module {name}\n{module.code}".encode())
        for node in module.graph.nodes:   # what the profile reads besides the code
            stack = [str(v) for v in (node.meta.get("nn_module_stack") or {}).values()]
            h.update(f"{node.name}|{node.meta.get('lynx_name')}|{stack}|{_tensor_meta(node.meta.get('val'))}\n".encode())
    for name, t in (*gm.named_parameters(), *gm.named_buffers()):
        h.update(f"{name}:{_tensor_meta(t)}\n".encode())
    for t in captured.example_inputs:
        h.update(f"input:{_tensor_meta(t)}\n".encode())
    return h.hexdigest()


def _to_json(prof: Profile) -> dict:
    return {"format": FORMAT, **dataclasses.asdict(prof)}


def _from_json(data: dict) -> Profile:
    """The profile a file holds, with the types :func:`profile` gives (tuples for shapes)."""
    if data.pop("format", None) != FORMAT:
        raise ValueError("another format")
    nodes = {}
    for name, fields in data.pop("nodes").items():
        fields["output_shapes"] = [tuple(s) for s in fields["output_shapes"]]
        nodes[name] = NodeProfile(**fields)
    data["input_shapes"] = [tuple(s) for s in data["input_shapes"]]
    return Profile(nodes=nodes, **data)


def _read(path: Path) -> Profile | None:
    try:
        return _from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None   # missing, torn or of another format: profiled again


def _write(folder: Path, path: Path, prof: Profile) -> None:
    """Atomically (ranks profiling the same model at once each write the same bytes); the
    oldest files beyond :data:`KEEP` go. A folder that cannot be written only loses the cache."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".profile-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(_to_json(prof), f)
        os.replace(tmp, path)
        files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in files[:-KEEP]:
            old.unlink(missing_ok=True)
            old.with_name(f".{old.stem}.lock").unlink(missing_ok=True)
    except OSError:
        return


def cached_profile(captured: Captured, target: str) -> Profile:
    """``profile(captured, target)``, read from the cache when this graph was profiled before."""
    folder = profile_cache_dir()
    key = profile_key(captured, target) if folder is not None else None
    if folder is None or key is None:
        return profile(captured, target=target)
    path = folder / f"{key}.json"
    found = _read(path)
    if found is not None and found.target == target:
        return found
    with _profiling(folder, key):   # a job's other ranks wait here, then read what this one wrote
        found = _read(path)
        if found is not None and found.target == target:
            return found
        prof = profile(captured, target=target)
        _write(folder, path, prof)
    return prof


@contextlib.contextmanager
def _profiling(folder: Path, key: str) -> Iterator[None]:
    """Hold ``key``'s lock file (``flock``: the kernel frees it when its process ends, however it
    ends) while profiling, so the ranks of a job starting on a cold cache profile once, not once
    each (seconds of CPU per rank). Without ``fcntl`` or a writable folder: no lock, each profiles."""
    try:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / f".{key}.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
