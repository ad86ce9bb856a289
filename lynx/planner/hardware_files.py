"""Hardware files: a :class:`~lynx.planner.hardware.HardwareSpec` in JSON or YAML, and clusters built on one.

A file takes one of two forms.

* **A whole device** — ``device: cpu`` or ``device: cuda`` and every field of
  :class:`~lynx.planner.hardware.HardwareSpec` (what ``lynx calibrate`` writes, with a
  ``calibration:`` block saying when, how long and how steady the measurement was).
* **A cluster** — ``device:`` names a preset or another hardware file (relative to this one) to
  take the device from, and the file overrides what differs, usually ``links``: per mesh
  dimension (``pp``, ``tp``, ``dp``) an ``alpha_s`` (one-way latency, s) and a
  ``beta_bytes_per_s`` (bandwidth per device and direction). A link given in part keeps the
  rest from the device; ``peak_flops``, ``optimizer_s_per_param`` and ``host_link`` (the link to
  host memory offload copies over: ``shared_by: 2`` where two devices share one) merge the same way.

A malformed or incomplete file is refused with the file and every field at fault named.
:func:`lynx.planner.hardware_ref.resolve_hardware` turns what ``--hardware`` takes (a preset,
``auto`` or a file's path) into a spec.

Example::

    >>> import pathlib, tempfile
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "my_cluster.yaml").write_text('''
    ... name: a100-nodes-25gbe
    ... device: a100-80g            # the device: a preset, or another hardware file
    ... links:
    ...   pp: {alpha_s: 30e-6, beta_bytes_per_s: 2.94e9}   # 25 GbE between nodes
    ...   dp: {alpha_s: 30e-6, beta_bytes_per_s: 2.94e9}
    ... ''')
    >>> spec = load_hardware_file(folder / "my_cluster.yaml")
    >>> spec.name, spec.links["dp"].beta_bytes_per_s, spec.links["tp"].beta_bytes_per_s   # tp: the preset's
    ('a100-nodes-25gbe', 2940000000.0, 300000000000.0)
    >>> _ = (folder / "bad.yaml").write_text("device: a100-80g\\nlinks:\\n  dp: {alpha_s: -1}\\n")
    >>> load_hardware_file(folder / "bad.yaml")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: hardware file .../bad.yaml: links.dp.alpha_s: -1 s is outside the physical range ...
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lynx import json_files
from lynx.errors import LynxConfigError
from lynx.planner.hardware import HARDWARE_PRESETS, Calibration, HardwareSpec
from lynx.planner.yaml_files import dumps, loads

__all__ = ["load_hardware_file", "write_hardware_file", "HARDWARE_SUFFIXES", "DOCS_HINT"]

HARDWARE_SUFFIXES = (".json", ".yaml", ".yml")
# dict fields a cluster file merges into its device's (host_link: e.g. only `shared_by: 2`)
_MERGED = ("peak_flops", "optimizer_s_per_param", "host_link")
DOCS_HINT = "the format: docs/hardware.md"


def load_hardware_file(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> HardwareSpec:
    """Read a hardware file (either form); ``source`` on the spec is its resolved path."""
    path = Path(path).expanduser().resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise LynxConfigError(f"hardware files name each other in a circle: {chain}")
    if not path.is_file():
        raise LynxConfigError(
            f"hardware file {path} does not exist (a preset name, 'auto' or a file path; {DOCS_HINT})"
        )
    data = _read(path)
    calibration = _calibration(data.pop("calibration", None), path)
    device = data.get("device")
    if device in ("cpu", "cuda"):
        fields = {"name": path.stem, **data}
    elif isinstance(device, str) and device:
        fields = _over_base(data, _base(device, path, _seen), path)
    else:
        raise LynxConfigError(
            f"hardware file {path}: device: {'missing' if device is None else f'got {device!r}'}; give 'cpu' or "
            f"'cuda' and every field of a device, or the name of a preset ({', '.join(HARDWARE_PRESETS)}) or "
            f"another hardware file to take the device from; {DOCS_HINT}"
        )
    try:
        spec = HardwareSpec.model_validate(fields)
    except ValidationError as err:
        raise LynxConfigError(f"hardware file {path}: {_explain(err)}; {DOCS_HINT}") from None
    return spec.model_copy(update={"source": str(path), "calibration": calibration})


def write_hardware_file(spec: HardwareSpec, path: str | os.PathLike) -> Path:
    """Write ``spec`` (and its calibration) as JSON (``.json``) or YAML (anything else), atomically."""
    path = Path(path).expanduser()
    data = {"name": spec.name, "device": spec.device, **spec.model_dump(mode="json", exclude_defaults=True)}
    if spec.calibration is not None:
        data["calibration"] = spec.calibration.model_dump(mode="json")
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=1) + "\n"
    else:
        text = f"# Lynx hardware file ({DOCS_HINT})\n" + dumps(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------- helpers
def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json_files.loads(text, f"hardware file {path}")  # a repeated key or NaN refused, as in YAML
    else:
        data = loads(text, f"hardware file {path}")
    if not isinstance(data, dict):
        raise LynxConfigError(
            f"hardware file {path}: expected a mapping of fields, got {type(data).__name__}; {DOCS_HINT}"
        )
    return data


def _base(device: str, path: Path, seen: tuple[Path, ...]) -> HardwareSpec:
    if device in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[device]
    candidate = (path.parent / device).expanduser()
    if candidate.suffix.lower() in HARDWARE_SUFFIXES or candidate.exists():
        return load_hardware_file(candidate, (*seen, path))
    raise LynxConfigError(
        f"hardware file {path}: device: {device!r} is neither 'cpu', 'cuda', a preset ({', '.join(HARDWARE_PRESETS)}) "
        f"nor a hardware file next to it; {DOCS_HINT}"
    )


def _over_base(data: dict[str, Any], base: HardwareSpec, path: Path) -> dict[str, Any]:
    """The base device's fields with the file's on top (links, peak_flops, optimizer steps merged)."""
    fields = base.model_dump(mode="json")
    fields["name"] = data.get("name", path.stem)
    for key, value in data.items():
        if key in ("device", "name"):
            continue
        if key == "links":
            if not isinstance(value, dict):
                raise LynxConfigError(
                    f"hardware file {path}: links: expected a mapping of pp, tp, dp to links; {DOCS_HINT}"
                )
            for dim, link in value.items():
                if dim not in fields["links"]:
                    raise LynxConfigError(
                        f"hardware file {path}: links.{dim}: unknown mesh dimension; use pp, tp or dp"
                    )
                if not isinstance(link, dict):
                    raise LynxConfigError(
                        f"hardware file {path}: links.{dim}: expected a mapping of alpha_s and "
                        f"beta_bytes_per_s, got {link!r}; {DOCS_HINT}"
                    )
                fields["links"][dim] = {**fields["links"][dim], **link}
        elif key in _MERGED and isinstance(value, dict):
            fields[key] = {**(fields.get(key) or {}), **value}
        else:
            fields[key] = value
    return fields


def _calibration(value: Any, path: Path) -> Calibration | None:
    if value is None:
        return None
    if isinstance(value, dict) and "method" not in value:
        value = {**value, "method": 1}   # written before calibrations were numbered
    try:
        return Calibration.model_validate(value)
    except ValidationError as err:
        raise LynxConfigError(f"hardware file {path}: calibration.{_explain(err)}") from None


def _explain(err: ValidationError) -> str:
    """Every problem as ``field.path: message (got value)``."""
    parts = []
    for item in err.errors():
        where = ".".join(str(p) for p in item.get("loc", ())) or "top level"
        kind, message = item.get("type"), item.get("msg", "invalid")
        if kind == "missing":
            parts.append(f"{where}: missing (required)")
        elif kind == "extra_forbidden":
            parts.append(f"{where}: unknown field")
        elif kind == "value_error":  # Lynx's own checks: the message names the value
            parts.append(f"{where}: {message.removeprefix('Value error, ')}")
        else:
            parts.append(f"{where}: {message} (got {item.get('input')!r})")
    return "; ".join(parts)
