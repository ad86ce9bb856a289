"""CompileConfig: validation with clear messages, size parsing, defaults, immutability."""

from __future__ import annotations

import pytest

from lynx.config import CompileConfig
from lynx.units import format_size, parse_size
from lynx.errors import LynxConfigError


@pytest.mark.parametrize("text,expected", [
    ("60GiB", 60 * 2**30), ("500MB", 500 * 10**6), ("1.5 TiB", int(1.5 * 2**40)), ("2e9", 2 * 10**9),
    (4096, 4096), ("512kib", 512 * 1024), ("10 b", 10),
])
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["60 parsecs", "", "GiB", -5, 0, "-1GiB", True, [1],
                                 "1e99", 1e99, float("inf"), float("nan"), 2**61])
def test_parse_size_rejects(bad) -> None:
    with pytest.raises(LynxConfigError):
        parse_size(bad)


def test_defaults_and_frozen() -> None:
    cfg = CompileConfig()
    assert (cfg.pp, cfg.dp, cfg.tp, cfg.schedule, cfg.solver, cfg.optimizer) == (1, 1, 1, "1f1b", "heu", "adamw")
    assert cfg.target == "cuda"
    assert CompileConfig(hardware="cpu-local").target == "cpu"
    with pytest.raises(Exception):
        cfg.pp = 4  # type: ignore[misc]
    assert cfg.replace(pp=2, microbatches=4).pp == 2 and cfg.pp == 1
    assert CompileConfig(memory_budget="40GiB").budget_bytes() == 40 * 2**30
    assert CompileConfig(hardware="h100-sxm").budget_bytes() == CompileConfig().hardware_spec().memory_bytes


@pytest.mark.parametrize("settings,message", [
    (dict(pp=0), "pp must be >= 1"),
    (dict(tp=-1), "tp must be >= 1"),
    (dict(pp=4, microbatches=2), "microbatches >= pp"),
    (dict(pp=4, microbatches=6, schedule="interleaved1f1b"), "multiple of pp"),
    (dict(time_limit_s=0), "time_limit_s must be > 0"),
    (dict(time_limit_s=-3), "time_limit_s must be > 0"),
    (dict(memory_budget="lots"), "cannot read memory size"),
    (dict(memory_budget=1e99), "more than any machine holds"),  # issue 22, finding 6
    (dict(solver="magic"), "solver"),
    (dict(optimizer="sgd"), "optimizer"),
    (dict(schedule="zigzag"), "schedule"),
    (dict(hardware="tpu-v9"), "unknown hardware"),
    (dict(pipeline=4), "unknown setting"),
    (dict(plan=42), "plan must be"),
])
def test_bad_settings_name_the_setting(settings, message) -> None:
    with pytest.raises(LynxConfigError, match=message):
        CompileConfig(**settings)


def test_gpipe_accepts_fewer_microbatches_than_stages() -> None:
    assert CompileConfig(pp=4, microbatches=2, schedule="gpipe").microbatches == 2


def test_fingerprint_fields_resolve_budget_and_hardware() -> None:
    fields = CompileConfig(pp=2, microbatches=4).fingerprint_fields()
    assert fields["memory_budget"] == CompileConfig().hardware_spec().memory_bytes
    assert fields["hardware"] == "h100-sxm" and "solver" not in fields
    assert format_size(3 * 2**30) == "3.00 GiB"
