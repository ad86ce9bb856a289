"""`CompileConfig`: every setting of :func:`lynx.compile`, validated once and frozen.

Sizes are given as bytes or strings (``"60GiB"``, ``"500MB"``, ``"1.5 TiB"``); bad values
raise :class:`lynx.LynxConfigError` naming the setting and what to do.

Example::

    >>> from lynx.config import CompileConfig
    >>> from lynx.units import parse_size
    >>> parse_size("60GiB") == 60 * 2**30
    True
    >>> cfg = CompileConfig(pp=4, microbatches=8, memory_budget="40GiB", solver="heu")
    >>> cfg.memory_budget == 40 * 2**30 and cfg.schedule == "1f1b"
    True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from lynx.errors import LynxConfigError
from lynx.planner.schedule import SCHEDULES
from lynx.solvers import SOLVERS
from lynx.units import parse_size

__all__ = [
    "CompileConfig",
    "SCHEDULES",
    "SOLVERS",
    "OPTIMIZERS",
    "FINGERPRINT_FIELDS",
]

OPTIMIZERS = ("adamw", "demo", "lion")
# Settings that change the planning problem: a plan made under other values is refused.
FINGERPRINT_FIELDS = (
    "pp", "dp", "tp", "microbatches", "schedule", "virtual_stages", "memory_budget",
    "hardware", "optimizer", "target",
)

class CompileConfig(BaseModel):
    """Settings of one compilation: parallelism, schedule, budget, hardware, optimizer, solver.

    ``memory_budget`` is per device (``None``: the hardware's memory); ``target`` defaults to
    the hardware's device (``"cpu"`` for ``cpu-local``, ``"cuda"`` for the GPU presets);
    ``hardware`` is a preset name, a hardware file's path, ``"auto"`` (this machine, measured
    once: :mod:`lynx.planner.hardware_cache`), a :class:`lynx.HardwareSpec` or its fields as a dict (as
    a saved plan records it) — a file or ``auto`` is recorded as the spec it resolves to; ``plan`` (a saved
plan's path or a :class:`lynx.Plan`) is used
    instead of solving.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    pp: int = 1
    dp: int = 1
    tp: int = 1
    microbatches: int = 8
    schedule: Literal["1f1b", "gpipe", "interleaved1f1b", "zbh1"] = "1f1b"
    virtual_stages: int = 2
    memory_budget: Optional[int] = None
    hardware: Any = "h100-sxm"
    optimizer: Literal["adamw", "demo", "lion"] = "adamw"
    solver: Literal["opt", "heu", "none", "full", "full-block", "selective", "checkmate", "offload-all",
                    "offload-modules"] = "heu"
    time_limit_s: float = 60.0
    plan: Any = None
    target: Optional[Literal["cuda", "cpu"]] = None
    seed: int = 0
    max_iterations: int = 3
    compile: bool = False          # stages pass their generated graphs through torch.compile (Inductor)
    # a fourth choice beside keep and recompute: copy saved values to host memory and back
    # (the hardware's host link; lynx.solvers.offload), within host_memory_budget per device
    # (None: the hardware's host_memory_bytes)
    offload: bool = False
    host_memory_budget: Optional[int] = None
    # tensor parallelism: module path (pattern) -> ColwiseParallel() / RowwiseParallel() or
    # "colwise" / "rowwise"; None: the default found from the repeated layer (lynx.frontend.sharding)
    tp_plan: Optional[dict[str, Any]] = None

    def __init__(self, **data: Any) -> None:
        unknown = sorted(set(data) - set(type(self).model_fields))
        if unknown:
            raise LynxConfigError(
                f"unknown setting(s) {', '.join(unknown)}; valid settings: {', '.join(type(self).model_fields)}"
            )
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise LynxConfigError(_explain(err)) from None

    @field_validator("pp", "dp", "tp", "microbatches", "virtual_stages", "max_iterations")
    @classmethod
    def _positive(cls, value: int, info: Any) -> int:
        if value < 1:
            hint = ""
            if info.field_name in ("dp", "pp") and "WORLD_SIZE" not in os.environ:
                # dp = world // pp in a script run without torchrun: a world of one
                hint = (" (no torchrun environment was found: this is a world of 1 process, where dp = world // pp "
                        "is 0; launch the script with `torchrun --nproc_per_node N SCRIPT.py`)")
            raise ValueError(f"{info.field_name} must be >= 1, got {value}{hint}")
        return value

    @field_validator("memory_budget", "host_memory_budget", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Optional[int]:
        if value is None:
            return None
        try:
            return parse_size(value)
        except LynxConfigError as err:
            raise ValueError(str(err)) from None

    @field_validator("tp_plan", mode="before")
    @classmethod
    def _tp_plan(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict) or not value or not all(isinstance(k, str) for k in value):
            raise ValueError(f"tp_plan must be a non-empty dict of module paths to ColwiseParallel() / "
                             f"RowwiseParallel() (or 'colwise' / 'rowwise'), got {value!r}")
        return dict(value)

    @field_validator("time_limit_s")
    @classmethod
    def _time_limit(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"time_limit_s must be > 0 seconds, got {value}")
        return float(value)

    @field_validator("hardware", mode="before")
    @classmethod
    def _hardware(cls, value: Any) -> Any:
        if isinstance(value, str):
            from lynx.planner.hardware import HARDWARE_PRESETS
            from lynx.planner.hardware_ref import resolve_hardware

            if value in HARDWARE_PRESETS:
                return value  # a preset is recorded by its name
            try:  # a hardware file or "auto": recorded as the spec it resolves to
                return resolve_hardware(value)
            except Exception as err:  # noqa: BLE001 - re-raised with the setting's name
                raise ValueError(str(err)) from None
        if hasattr(value, "model_dump") and hasattr(value, "links"):
            return value
        if isinstance(value, dict):  # a spec as a saved plan records it (hardware_record)
            from lynx.planner.hardware import HardwareSpec

            try:
                return HardwareSpec.model_validate(value)
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(part) for part in first.get("loc", ()))
                raise ValueError(
                    f"hardware spec is invalid at {where or 'top level'}: {first.get('msg')} "
                    f"({err.error_count()} problem(s)); see lynx.HardwareSpec's fields"
                ) from None
        raise ValueError(
            f"hardware must be a preset name, a hardware file's path, 'auto', a lynx.HardwareSpec or its fields "
            f"as a dict, got {value!r}"
        )

    @field_validator("plan", mode="before")
    @classmethod
    def _plan(cls, value: Any) -> Any:
        if value is None or isinstance(value, (str, Path)):
            return value
        from lynx.plan import Plan

        if isinstance(value, Plan):
            return value
        raise ValueError(f"plan must be a path to a saved plan or a lynx.Plan, got {type(value).__name__}")

    @model_validator(mode="after")
    def _consistent(self) -> "CompileConfig":
        if self.target is None:
            device = getattr(self.hardware, "device", None)  # a spec says its device
            if device not in ("cpu", "cuda"):
                device = "cpu" if str(self.hardware).startswith("cpu") else "cuda"
            object.__setattr__(self, "target", device)
        if self.tp_plan is not None and self.tp == 1:
            raise ValueError("tp_plan shards layers across tensor-parallel ranks: it needs tp > 1 (got tp=1)")
        if self.schedule == "1f1b" and self.microbatches < self.pp:
            raise ValueError(
                f"schedule '1f1b' needs microbatches >= pp ({self.microbatches} < {self.pp}): "
                f"raise microbatches to at least {self.pp} or use schedule='gpipe'"
            )
        if self.offload:
            from lynx.planner.host_link import host_link_of
            from lynx.planner.offload_costs import check_offload_schedule

            try:
                check_offload_schedule(self.schedule, self.virtual)
                host_link_of(self.hardware_spec())
            except LynxConfigError as err:
                raise ValueError(str(err)) from None
        elif self.host_memory_budget is not None:
            raise ValueError("host_memory_budget is the pinned host memory offload may fill: set offload=True with it")
        elif self.solver in ("offload-all", "offload-modules"):
            raise ValueError(f"solver {self.solver!r} is an offload baseline: set offload=True with it")
        if self.schedule == "interleaved1f1b":
            if self.pp < 2:
                raise ValueError("schedule 'interleaved1f1b' needs pp >= 2; use '1f1b' for one stage")
            if self.virtual_stages < 2:
                raise ValueError("schedule 'interleaved1f1b' needs virtual_stages >= 2")
            if self.microbatches < self.pp or self.microbatches % self.pp:
                raise ValueError(
                    f"schedule 'interleaved1f1b' needs microbatches to be a multiple of pp and >= pp "
                    f"(got microbatches={self.microbatches}, pp={self.pp})"
                )
        return self

    # ----------------------------------------------------------------- helpers
    @property
    def virtual(self) -> int:
        """Model chunks per device: ``virtual_stages`` for the interleaved schedule, else 1."""
        return self.virtual_stages if self.schedule == "interleaved1f1b" else 1

    def hardware_spec(self) -> Any:
        """The resolved :class:`lynx.HardwareSpec`."""
        from lynx.planner.hardware_ref import resolve_hardware

        return resolve_hardware(self.hardware)

    def budget_bytes(self) -> int:
        """The per-device memory budget in bytes (the hardware's memory when unset)."""
        if self.memory_budget is not None:
            return int(self.memory_budget)
        return int(self.hardware_spec().memory_bytes)

    def host_budget_bytes(self) -> Optional[int]:
        """Pinned host memory offload may fill per device (None: offload off, or no limit known)."""
        if not self.offload:
            return None
        if self.host_memory_budget is not None:
            return int(self.host_memory_budget)
        return getattr(self.hardware_spec(), "host_memory_bytes", None)

    def hardware_record(self) -> Any:
        """JSON-ready form of ``hardware``: the preset name or the spec's fields."""
        if isinstance(self.hardware, str):
            return self.hardware
        return self.hardware.model_dump(mode="json")

    def record(self) -> dict[str, Any]:
        """JSON-ready dict of the settings (the plan field left out; the offload settings only
        when offload is on; a tp_plan's styles by name)."""
        data = self.model_dump(mode="python", exclude={"plan", "hardware", "tp_plan"})
        if not self.offload:
            del data["offload"], data["host_memory_budget"]
        data["hardware"] = self.hardware_record()
        if self.tp_plan is not None:
            data["tp_plan"] = {path: _style_record(style) for path, style in self.tp_plan.items()}
        return data

    def fingerprint_fields(self) -> dict[str, Any]:
        """The settings a plan depends on (see :data:`FINGERPRINT_FIELDS`; with tp > 1 the sharding
        plan too, as :func:`lynx.compile` resolved it)."""
        record = self.record()
        if self.memory_budget is None:
            record["memory_budget"] = self.budget_bytes()
        fields = {name: record[name] for name in FINGERPRINT_FIELDS}
        if self.offload:   # only then: plans made before offload existed keep their fingerprints
            fields["offload"] = True
            fields["host_memory_budget"] = self.host_budget_bytes()
        if self.tp > 1:
            fields["tp_plan"] = record.get("tp_plan")
        return fields

    def replace(self, **changes: Any) -> "CompileConfig":
        """A copy with some settings changed (re-validated)."""
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(changes)
        return CompileConfig(**data)


def _style_record(style: Any) -> str:
    """A tensor-parallel style as a plan records it: ``"colwise"`` / ``"rowwise"`` (strings as given)."""
    if isinstance(style, str):
        return style
    names = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise"}
    return names.get(type(style).__name__, type(style).__name__)


def _explain(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(part) for part in item.get("loc", ()))
        message = item.get("msg", "invalid value")
        message = message.removeprefix("Value error, ")
        if item.get("type") == "literal_error":
            message = f"{message} (got {item.get('input')!r})"
        lines.append(f"{where}: {message}" if where and where not in message else message)
    return "invalid CompileConfig: " + "; ".join(lines)
