"""``benchmarks/gpu_check.py`` on the CPU: the report's shape, and every check that can run
without CUDA passes (the GPU run itself happens on a lent H200: docs/gpu.md)."""

from __future__ import annotations

import doctest
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402
from gpu_check_common import VERDICTS, CheckResult, Part  # noqa: E402

IN_PROCESS = ["saved_bytes", "peak_memory", "gradients", "time", "offload", "optimizers"]


def _shape(report: dict, checks: list[str]) -> None:
    assert report["device_type"] == "cpu" and report["device"].startswith("cpu")
    assert list(report["checks"]) == checks
    for name, check in report["checks"].items():
        assert set(check) >= {"figure", "verdict", "reason", "parts", "seconds"}, name
        assert check["verdict"] in VERDICTS and check["reason"], name
        assert check["parts"], f"{name} has no parts"
        for part_name, part in check["parts"].items():
            assert set(part) == {"figure", "verdict", "reason"}, (name, part_name)
            assert part["verdict"] in VERDICTS, (name, part_name)
            if part["verdict"] == "skipped":
                assert part["reason"], f"{name}/{part_name} is skipped without a reason"


def test_cpu_run_passes_what_runs_without_cuda(tmp_path: Path) -> None:
    code = gpu_check.main(["--device", "cpu", "--size", "tiny", "--calibrate", "never", "--out", str(tmp_path),
                           "--checks", ",".join(IN_PROCESS)])
    assert not (tmp_path / "gpu_check.json").exists(), "a CPU run must not write the GPU report's name"
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    _shape(report, IN_PROCESS)
    verdicts = {name: c["verdict"] for name, c in report["checks"].items()}
    assert verdicts == {"saved_bytes": "pass", "peak_memory": "pass", "gradients": "pass", "time": "skipped",
                        "offload": "pass", "optimizers": "pass"}, {n: c["reason"] for n, c in report["checks"].items()}
    assert code == 0
    checks = report["checks"]
    # what needs CUDA is skipped and says so; what can run ran
    assert all(p["verdict"] == "skipped" and "CUDA" in p["reason"]
               for n, p in checks["peak_memory"]["parts"].items() if "allocator" in n)
    assert checks["peak_memory"]["parts"]["heu/meter_vs_plan"]["figure"]["windowed_nodes"] > 0
    assert checks["gradients"]["parts"]["full"]["figure"]["dropped_dropout_nodes"] > 0
    assert checks["time"]["parts"]["cpu-local/none"]["figure"]["measured_s"] > 0
    assert checks["optimizers"]["parts"]["host_syncs"]["verdict"] == "skipped"
    # offload: the copies ran (synchronously) and the gradients and memory are the plan's; the
    # overlap and step-time parts wait for a device
    offload = checks["offload"]["parts"]
    assert checks["offload"]["figure"]["offloaded_bytes_per_microbatch"] > 0
    assert offload["offload-all/gradients"]["verdict"] == offload["offload-all/meter_vs_plan"]["verdict"] == "pass"
    assert all(offload[f"offload-all/{p}"]["verdict"] == "skipped" and "CUDA" in offload[f"offload-all/{p}"]["reason"]
               for p in ("copy_overlap", "step_vs_plan"))
    assert "not a GPU report" in (tmp_path / "gpu_check_cpu.md").read_text()


@pytest.mark.slow
def test_cpu_process_group_two_ranks(tmp_path: Path) -> None:
    gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--checks", "process_group"])
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    _shape(report, ["process_group"])
    parts = report["checks"]["process_group"]["parts"]
    assert parts["2ranks"]["verdict"] == "pass", parts["2ranks"]["reason"]
    assert parts["2ranks"]["figure"]["ranks"] == 2 and parts["2ranks"]["figure"]["params_differing"] == 0
    assert parts["nccl_1rank"]["verdict"] == "skipped"


def test_harness_reports_failures_errors_and_the_time_budget(tmp_path: Path, monkeypatch) -> None:
    def failing(env):
        return CheckResult({"x": 1}, "one part failed", {"a": Part({}, "pass"), "b": Part({"y": 2}, "fail", "no")})

    def broken(env):
        raise ValueError("boom | with a pipe")

    monkeypatch.setattr(gpu_check, "_checks", lambda: {"saved_bytes": failing, "gradients": broken})
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--checks", "saved_bytes,gradients"])
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert code == 1
    assert report["checks"]["saved_bytes"]["verdict"] == "fail"
    assert report["checks"]["gradients"]["verdict"] == "fail"
    assert report["checks"]["gradients"]["reason"].startswith("error: ValueError: boom")
    assert "boom \\| with a pipe" in (tmp_path / "gpu_check_cpu.md").read_text()  # table cells stay cells
    gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--checks", "saved_bytes", "--budget-s", "-1"])
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert report["checks"]["saved_bytes"]["verdict"] == "skipped"
    assert "time budget" in report["checks"]["saved_bytes"]["reason"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--checks", "nonsense"])


def test_optimizer_comparison_tells_rounding_from_a_wrong_step() -> None:
    from gpu_check_optim import LR, compare_runs, within_rounding

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(100, 1000, generator=gen)]
    state = {"0.momentum": torch.randn(100, 1000, generator=gen)}
    ref, lr, top = (params, state, []), LR["demo"], float(params[0].abs().max())

    def run(delta_param: float = 0.0, delta_state: float = 0.0, count: int = 1) -> dict:
        p, s = params[0].clone(), state["0.momentum"].clone()
        p.view(-1)[:count] += delta_param
        s.view(-1)[:count] += delta_state
        return compare_runs("demo", ref, ([p], {"0.momentum": s}, []))

    assert within_rounding(run()) and run()["bitwise_params"]
    ulp = run(delta_param=top * 2**-23)
    assert within_rounding(ulp) and not ulp["bitwise_params"]
    assert within_rounding(run(delta_param=2 * lr))                  # one sign taken the other way in 1e5
    assert not within_rounding(run(delta_param=2 * lr, count=50))    # 0.05% of the signs: not rounding
    assert not within_rounding(run(delta_param=0.2 * lr))             # off by neither rounding nor a flip
    assert not within_rounding(run(delta_state=0.5, count=1000))      # 1% of the momentum elsewhere


@pytest.mark.parametrize("name", ["gpu_check_common", "gpu_check_saved", "gpu_check_optim"])
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
