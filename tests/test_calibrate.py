"""`lynx calibrate` and `hardware="auto"`: a real measurement of this machine, cached and reused."""

from __future__ import annotations

import pytest

from typer.testing import CliRunner

from lynx.calibrate.repeats import Repeated
from lynx.cli import app
from lynx.config import CompileConfig
from lynx.planner.hardware_cache import auto_path
from lynx.planner.hardware_files import load_hardware_file

MEASURED = ("peak_flops.float32", "peak_flops.bfloat16", "memory_bandwidth", "op_overhead_s", "rng_s_per_element",
            "optimizer_s_per_param.demo", "links.alpha_s", "links.beta_bytes_per_s", "host_link.d2h_bytes_per_s",
            "host_link.alpha_s")


def test_repeated_median_and_spread() -> None:
    m = Repeated("x", [3.0, 1.0, 2.0])
    assert m.median == 2.0 and m.spread == 1.0
    assert Repeated("steady", [5.0, 5.0]).spread == 0.0


def test_cli_calibrate_writes_the_cache_and_a_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LYNX_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(
        app, ["calibrate", "--repeats", "2", "--device", "cpu", "-o", str(tmp_path / "me.yaml")]
    )
    assert result.exit_code == 0, result.output
    assert "spread" in result.output and "calibrated in" in result.output
    spec = load_hardware_file(tmp_path / "me.yaml")
    cal = spec.calibration
    assert spec.device == "cpu" and cal.repeats == 2 and cal.threads == 1 and cal.seconds > 0
    assert set(MEASURED) <= set(cal.spread) and all(v >= 0 for v in cal.spread.values())
    assert all(r > 0 for r in spec.peak_flops.values()) and spec.memory_bandwidth > 0 and spec.op_overhead_s > 0
    assert set(spec.optimizer_s_per_param) == {"adamw", "demo", "lion"}
    assert spec.links["pp"] == spec.links["dp"] and spec.links["pp"].alpha_s > 0
    # offload on a CPU: a memcpy on the compute thread, measured
    assert spec.host_link.synchronous and spec.host_link.h2d_bytes_per_s > 1e8 and spec.host_memory_bytes > 0
    assert load_hardware_file(auto_path()).model_dump() == spec.model_dump()  # the cache `auto` reads
    bad = CliRunner().invoke(app, ["calibrate", "--repeats", "0"])
    assert bad.exit_code == 2 and "--repeats must be >= 1" in bad.output


def test_auto_measures_once_then_reuses(tmp_path, monkeypatch, capfd) -> None:
    monkeypatch.setenv("LYNX_CACHE_DIR", str(tmp_path))
    assert not auto_path().exists()
    config = CompileConfig(hardware="auto", pp=2, microbatches=2)  # no cache: measured in a subprocess
    assert "no measurement of this host yet" in capfd.readouterr().err
    path = auto_path()
    stamp = path.stat().st_mtime_ns
    spec = config.hardware
    assert spec.source == str(path.resolve()) and spec.calibration.repeats == 5 and config.target == "cpu"
    record = config.hardware_record()
    assert record["name"] == spec.name and "calibration" not in record
    again = CompileConfig(hardware="auto", pp=2, microbatches=2)  # reused, not measured again
    assert path.stat().st_mtime_ns == stamp and again.fingerprint_fields() == config.fingerprint_fields()
    assert "measuring" not in capfd.readouterr().err


def test_generated_op_overhead_is_the_residual_per_generated_op() -> None:
    """The reference's generated graphs, timed for real, less the arithmetic the rates price,
    shared over the ops they run; never below the eager op overhead given as the floor."""
    from lynx.calibrate.cpu import ReferenceModel, generated_graphs_s, generated_op_overhead_s

    reference = ReferenceModel()
    graphs_s = generated_graphs_s(reference, in_flight=2, runs=1)
    assert 1e-4 < graphs_s < 5.0
    G = reference.analysis.graph
    ops = sum(G.nodes[n]["forward_ops"] + G.nodes[n]["backward_ops"] for n in G)
    # the fastest device HardwareSpec admits (PHYSICAL_RANGES): its arithmetic costs ~nothing
    free = {"matmul_flops": 1e18, "memory_bandwidth": 1e15, "rng_s_per_element": 0.0}
    assert generated_op_overhead_s(reference, free, graphs_s) == pytest.approx(graphs_s / ops, rel=1e-3)
    slow = {"matmul_flops": 1e6, "memory_bandwidth": 1e6, "rng_s_per_element": 1e-3}  # priced above any time
    assert generated_op_overhead_s(reference, slow, graphs_s, floor_s=3e-6) == 3e-6
