"""Hardware files (JSON, YAML, clusters on a preset or another file), their errors, and --hardware."""

from __future__ import annotations


import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lynx.cli import app
from lynx.config import CompileConfig
from lynx.errors import LynxConfigError
from lynx.planner.hardware import HARDWARE_PRESETS, Calibration
from lynx.planner.hardware_files import load_hardware_file, write_hardware_file
from lynx.planner.hardware_ref import resolve_hardware
from lynx.planner.yaml_files import dumps, loads

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hardware" / "ethernet_cluster.yaml"


def test_yaml_reads_numbers_as_yaml_1_2_does() -> None:
    text = (
        "a: 1e12  # a number (YAML 1.1 would read a string)\nb: {c: 2, d: [x, 'y z']}\ne:\n  f: \"q: #\"\n  g: true\n"
    )
    assert loads(text, "t.yaml") == {"a": 1e12, "b": {"c": 2, "d": ["x", "y z"]}, "e": {"f": "q: #", "g": True}}
    data = {"n": "a, b: c", "x": 2.5e-6, "l": ["p, q", 1], "m": {"k": None}, "s": "1e3"}
    assert loads(dumps(data), "t.yaml") == data


@pytest.mark.parametrize(
    "text,message",
    [
        ("a: 1\na: 2", "t.yaml, line 2: 'a' is given twice"),
        ("a: {b: 1", "t.yaml, line 1: not valid YAML"),
        ("a:\n\tb: 1", "t.yaml, line 2: not valid YAML"),
        ("a: 1\n  b: 2", "t.yaml, line 2: not valid YAML"),
    ],
)
def test_yaml_errors_name_the_file_and_line(text, message) -> None:
    with pytest.raises(LynxConfigError, match=re.escape(message)):
        loads(text, "t.yaml")


def test_the_documented_ethernet_cluster_loads() -> None:
    spec = resolve_hardware(str(EXAMPLE))
    a100 = HARDWARE_PRESETS["a100-80g"]
    assert spec.name == "a100-8x8-25gbe" and spec.source == str(EXAMPLE)
    assert spec.peak_flops == a100.peak_flops and spec.memory_bytes == a100.memory_bytes  # the device: the preset's
    assert spec.links["pp"].beta_bytes_per_s == spec.links["dp"].beta_bytes_per_s == 0.37e9
    assert spec.links["tp"] == a100.links["tp"]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "hardware.md").read_text()
    assert EXAMPLE.read_text().strip() in doc, "docs/hardware.md shows examples/hardware/ethernet_cluster.yaml"


def test_whole_spec_round_trips_in_json_and_yaml(tmp_path) -> None:
    cal = Calibration(
        host="h",
        date="2026-12-03T00:00:00+00:00",
        seconds=12.5,
        repeats=5,
        threads=1,
        cpus=2,
        load_before=0.5,
        load_after=0.7,
        torch="2.x",
        spread={"memory_bandwidth": 0.04},
        notes=["a, b: c"],
    )
    spec = HARDWARE_PRESETS["cpu-local"].model_copy(update={"name": "mine", "calibration": cal})
    for name in ("mine.json", "mine.yaml"):
        back = load_hardware_file(write_hardware_file(spec, tmp_path / name))
        assert back.model_dump() == spec.model_dump() and back.calibration == cal
        assert back.source == str((tmp_path / name).resolve())


def test_cluster_on_another_file_merges_links_and_dicts(tmp_path) -> None:
    write_hardware_file(HARDWARE_PRESETS["cpu-local"].model_copy(update={"name": "host"}), tmp_path / "host.json")
    (tmp_path / "two.yaml").write_text(
        "name: two-hosts\ndevice: host.json\nlinks:\n  dp: {beta_bytes_per_s: 1.25e8}\n"
        "optimizer_s_per_param: {demo: 2e-8}\n"
    )
    spec = resolve_hardware(tmp_path / "two.yaml")
    host = HARDWARE_PRESETS["cpu-local"]
    assert spec.links["dp"].beta_bytes_per_s == 1.25e8 and spec.links["dp"].alpha_s == host.links["dp"].alpha_s
    assert spec.optimizer_s_per_param == {**host.optimizer_s_per_param, "demo": 2e-8}
    assert spec.device == "cpu" and spec.memory_bandwidth == host.memory_bandwidth


@pytest.mark.parametrize(
    "body,field",
    [
        (
            "device: a100-80g\nlinks:\n  dp: {alpha_s: -1}\n",
            "links.dp.alpha_s: -1 s is outside the physical range [0, 60] s",
        ),
        # finding 5 of issue 22: values without bounds reached the solvers or the plan
        ("device: a100-80g\nlinks:\n  pp: {alpha_s: 1e30}\n", "links.pp.alpha_s: 1e+30 s is outside"),
        ("device: a100-80g\nmemory_bandwidth: .inf\n", "memory_bandwidth: Input should be a finite number"),
        ("device: a100-80g\npeak_flops: {float32: 1e-30}\n", "peak_flops.float32: 1e-30 FLOP/s is outside"),
        ("device: a100-80g\nmemory_bytes: 1e17\n", "memory_bytes: 1e+17 bytes is outside"),
        ('{"device": "a100-80g", "name": "x", "name": "y"}', "'name' is given twice in one object (line 1)"),
        ('{"device": "a100-80g", "memory_bandwidth": NaN}', "NaN is not a JSON number"),
        ("device: a100-80g\nlinks:\n  ep: {alpha_s: 1}\n", "links.ep: unknown mesh dimension"),
        ("device: a100-80g\nlink_speed: 3\n", "link_speed: unknown field"),
        ("device: cpu\nname: x\n", "peak_flops: missing (required)"),
        ("device: tpu\n", "device: 'tpu' is neither"),
        ("name: x\n", "device: missing"),
        ('{"device": "cuda",', "not valid JSON"),
    ],
)
def test_bad_files_name_the_file_and_field(tmp_path, body, field) -> None:
    path = tmp_path / ("bad.json" if body.startswith("{") else "bad.yaml")
    path.write_text(body)
    with pytest.raises(LynxConfigError) as err:
        resolve_hardware(str(path))
    assert str(path) in str(err.value) and field in str(err.value)


def test_missing_file_circle_and_unknown_name(tmp_path) -> None:
    with pytest.raises(LynxConfigError, match="does not exist"):
        resolve_hardware(str(tmp_path / "nope.yaml"))
    (tmp_path / "a.yaml").write_text("device: b.yaml\n")
    (tmp_path / "b.yaml").write_text("device: a.yaml\n")
    with pytest.raises(LynxConfigError, match="in a circle"):
        resolve_hardware(str(tmp_path / "a.yaml"))
    with pytest.raises(LynxConfigError, match="a preset .*'auto'.*hardware file"):
        resolve_hardware("tpu-v5")


def test_compile_config_records_a_file_as_its_spec(tmp_path) -> None:
    cfg = CompileConfig(hardware=str(EXAMPLE), pp=2, microbatches=2)
    assert cfg.hardware.name == "a100-8x8-25gbe" and cfg.target == "cuda"
    record = cfg.hardware_record()
    assert isinstance(record, dict) and "source" not in record and "calibration" not in record
    assert CompileConfig(hardware=record, pp=2, microbatches=2).fingerprint_fields() == cfg.fingerprint_fields()
    (tmp_path / "bad.yaml").write_text("device: a100-80g\nlinks:\n  pp: {beta_bytes_per_s: 0}\n")
    with pytest.raises(LynxConfigError, match="hardware.*bad.yaml.*links.pp.beta_bytes_per_s"):
        CompileConfig(hardware=str(tmp_path / "bad.yaml"))


def test_cli_plans_gpt_13b_on_the_ethernet_cluster(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "gpt-13b",
            "--pp",
            "4",
            "--tp",
            "8",
            "--dp",
            "2",
            "-m",
            "8",
            "--optimizer",
            "demo",
            "--hardware",
            str(EXAMPLE),
            "-b",
            "12GiB",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["config"]["hardware"]["name"] == "a100-8x8-25gbe"
    assert plan["config"]["hardware"]["links"]["dp"]["beta_bytes_per_s"] == 0.37e9
    bad = tmp_path / "bad.yaml"
    bad.write_text("device: a100-80g\nlinks: 3\n")
    result = CliRunner().invoke(app, ["plan", "gpt-tiny", "--hardware", str(bad)])
    assert result.exit_code == 2 and "bad.yaml" in result.output and "links" in result.output


def test_a_calibration_written_before_methods_were_numbered_reads_as_method_1(tmp_path) -> None:
    import json

    from lynx.planner.hardware import CALIBRATION_METHOD
    from lynx.planner.hardware_cache import stale_reason

    cal = Calibration(host="h", date="2026-12-03T00:00:00+00:00", seconds=12.5, repeats=5, threads=1, cpus=2,
                      load_before=0.5, load_after=0.7, torch="2.x")
    path = write_hardware_file(HARDWARE_PRESETS["cpu-local"].model_copy(update={"calibration": cal}),
                               tmp_path / "hw.json")
    assert load_hardware_file(path).calibration.method == CALIBRATION_METHOD
    data = json.loads(path.read_text())
    del data["calibration"]["method"]
    path.write_text(json.dumps(data))
    old = load_hardware_file(path).calibration
    assert old.method == 1
    assert "older `lynx calibrate`" in stale_reason(old, load=0.5, cpus=2)
