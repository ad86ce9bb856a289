"""`lynx calibrate` and `hardware="auto"`: a real measurement of this machine, cached and reused."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from typer.testing import CliRunner

from lynx.calibrate.host import unreliable_figures
from lynx.calibrate.repeats import Repeated, fastest
from lynx.cli import app
from lynx.config import CompileConfig
from lynx.planner import hardware_cache
from lynx.planner.hardware_cache import auto_path
from lynx.planner.hardware_files import load_hardware_file

MEASURED = ("peak_flops.float32", "peak_flops.bfloat16", "memory_bandwidth", "op_overhead_s", "rng_s_per_element",
            "optimizer_s_per_param.demo", "runtime_action_s", "links.alpha_s", "links.beta_bytes_per_s",
            "links.tp.alpha_s", "links.tp.beta_bytes_per_s", "host_link.d2h_bytes_per_s", "host_link.alpha_s")
CPU_TIMED = ("peak_flops.float32", "memory_bandwidth", "op_overhead_s", "optimizer_s_per_param.demo")


def test_repeated_median_and_spread() -> None:
    m = Repeated("x", [3.0, 1.0, 2.0], [0.9, 0.4, 1.0])
    assert m.median == 2.0 and m.spread == 1.0 and m.cpu_share == 0.4
    assert Repeated("steady", [5.0, 5.0]).spread == 0.0 and Repeated("wall").cpu_share is None


def test_fastest_is_the_least_cpu_time_and_reports_the_core_share() -> None:
    import time

    def sleepy() -> None:   # sleeping takes wall time and no CPU time
        time.sleep(0.01)

    t = fastest(sleepy, runs=3)
    assert t.seconds < 0.005 and t.cpu_share < 0.5
    spins = fastest(lambda: sum(range(20000)), runs=2, min_total_s=0.02)
    assert spins.seconds > 0 and 0 < spins.cpu_share <= 1.0


def test_unreliable_figures_name_the_spread_and_why() -> None:
    steady = Repeated("peak_flops.float32", [100.0, 104.0, 98.0], [0.9] * 3)
    busy = Repeated("op_overhead_s", [3.0, 4.0, 3.2], [0.3, 0.5, 0.6])
    link = Repeated("links.alpha_s", [30e-6, 45e-6, 36e-6], best="min")
    single = Repeated("memory_bandwidth", [1e9])
    out = unreliable_figures([steady, busy, link, single], load=5.5, cpus=2)
    assert set(out) == {"op_overhead_s", "links.alpha_s"}
    assert "repeats is 25% from their median" in out["op_overhead_s"] and "30% of a core" in out["op_overhead_s"]
    assert "two best of 3 repeats differ by 20%" in out["links.alpha_s"]
    assert "both processes on a core" in out["links.alpha_s"] and "load 5.5 on 2 cpus" in out["links.alpha_s"]
    assert unreliable_figures([Repeated("links.alpha_s", [30e-6, 45e-6, 31e-6], best="min")], 0.1, 2) == {}
    starved = Repeated("op_overhead_s", [4.9e-6, 4.9e-6, 5.0e-6], [0.02, 0.04, 0.03], best="min")
    assert "more than 4% of a core" in unreliable_figures([starved], 18.4, 2)["op_overhead_s"]
    fed = Repeated("op_overhead_s", [3.1e-6, 3.2e-6, 3.2e-6], [0.02, 0.3, 0.03], best="min")
    assert unreliable_figures([fed], 6.0, 2) == {}
    # β is the best repeat (the vCPUs sharing a cache): a lone one is flagged, two agreeing are not
    lone = Repeated("links.beta_bytes_per_s", [3.3e9, 7.0e9, 3.4e9], best="max")
    assert lone.value == 7.0e9 and "share a cache" in unreliable_figures([lone], 4.0, 2)["links.beta_bytes_per_s"]
    assert unreliable_figures([Repeated("links.beta_bytes_per_s", [3.3e9, 7.0e9, 6.8e9], best="max")], 0.5, 2) == {}
    # the TP stage's figure, however steady its blocks, is the moment's where other processes took the cores
    crowded = Repeated("links.tp.alpha_s", [5.0e-4, 5.1e-4, 5.0e-4], others_cpus=0.8)
    assert "other processes took 0.80 cpus" in unreliable_figures([crowded], 7.0, 2)["links.tp.alpha_s"]
    crowded.others_cpus = 0.05
    assert unreliable_figures([crowded], 1.0, 2) == {}


@pytest.fixture(scope="module")
def auto_measured(tmp_path_factory) -> tuple[str, object, str]:
    """This host measured for real, once for the file (~30 CPU-s): ``hardware="auto"`` with no
    cached measurement runs ``python -m lynx.calibrate`` (5 repeats) in a subprocess. Returns the
    cache folder, the config and what the caller was told on stderr."""
    folder = tmp_path_factory.mktemp("auto-cache")
    told = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(told):
        patch.setenv("LYNX_CACHE_DIR", str(folder))
        assert not auto_path().exists()
        config = CompileConfig(hardware="auto", pp=2, microbatches=2)  # no cache: measured in a subprocess
        config.hardware
    return str(folder), config, told.getvalue()


def test_cli_calibrate_writes_the_cache_and_a_file(tmp_path, monkeypatch, auto_measured) -> None:
    """`lynx calibrate` passes its options to calibrate_host and writes what it measured to the
    cache ``auto`` reads and to ``-o``. The measurement checked is the file's one real run
    (auto_measured: the same calibrate_host, 5 repeats): measuring twice would only cost time."""
    import lynx.calibrate

    measured = auto_measured[1].hardware
    calls: list[tuple] = []

    def measure_once(progress: bool = True, repeats: int = 5, device: str | None = None):
        calls.append((progress, repeats, device))
        return measured

    monkeypatch.setattr(lynx.calibrate, "calibrate_host", measure_once)
    monkeypatch.setenv("LYNX_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(
        app, ["calibrate", "--repeats", "2", "--device", "cpu", "-o", str(tmp_path / "me.yaml")]
    )
    assert result.exit_code == 0, result.output
    assert calls == [(True, 2, "cpu")]
    assert "spread" in result.output and "calibrated in" in result.output and "runtime_action_s" in result.output
    spec = load_hardware_file(tmp_path / "me.yaml")
    cal = spec.calibration
    assert spec.device == "cpu" and cal.repeats == 5 and cal.threads == 1 and cal.seconds > 0
    assert set(MEASURED) <= set(cal.spread) and all(v >= 0 for v in cal.spread.values())
    assert set(CPU_TIMED) <= set(cal.cpu_share) and all(0 < v <= 1 for v in cal.cpu_share.values())
    assert set(cal.unreliable) <= set(cal.spread)
    # (which repeats make a figure unreliable — the spread, or a best-of figure's two best, or a
    # starved core — is test_unreliable_figures_name_the_spread_and_why's; the file says why)
    assert all("Measure again" in why for why in cal.unreliable.values())
    assert all("10%" in why or "of a core" in why for why in cal.unreliable.values())
    assert 0 < spec.runtime_action_s < 0.01 and any(n.startswith("runtime: lynx.runtime.Pipeline") for n in cal.notes)
    assert all(r > 0 for r in spec.peak_flops.values()) and spec.memory_bandwidth > 0 and spec.op_overhead_s > 0
    assert set(spec.optimizer_s_per_param) == {"adamw", "demo", "lion"}
    assert spec.links["pp"] == spec.links["dp"] and spec.links["pp"].alpha_s > 0
    # tp: all-reduces as a TP stage issues them, plus what each costs inside a sharded stage
    assert spec.links["tp"] != spec.links["pp"] and spec.links["tp"].alpha_s > 0
    assert any("tp: the functional all-reduce" in n and "per collective" in n for n in cal.notes)
    assert "links.tp.alpha_s" in result.output
    # offload on a CPU: a memcpy on the compute thread, measured
    assert spec.host_link.synchronous and spec.host_link.h2d_bytes_per_s > 1e8 and spec.host_memory_bytes > 0
    assert load_hardware_file(auto_path()).model_dump() == spec.model_dump()  # the cache `auto` reads
    bad = CliRunner().invoke(app, ["calibrate", "--repeats", "0"])
    assert bad.exit_code == 2 and "--repeats must be >= 1" in bad.output


def test_auto_measures_once_then_reuses(monkeypatch, capfd, auto_measured) -> None:
    folder, config, told = auto_measured   # no cache: measured in a subprocess
    monkeypatch.setenv("LYNX_CACHE_DIR", folder)
    assert "no measurement of this host yet" in told
    path = auto_path()
    stamp = path.stat().st_mtime_ns
    spec = config.hardware
    assert spec.source == str(path.resolve()) and spec.calibration.repeats == 5 and config.target == "cpu"
    record = config.hardware_record()
    assert record["name"] == spec.name and "calibration" not in record
    again = CompileConfig(hardware="auto", pp=2, microbatches=2)  # reused, not measured again
    assert path.stat().st_mtime_ns == stamp and again.fingerprint_fields() == config.fingerprint_fields()
    assert "measuring" not in capfd.readouterr().err
    # a measurement older than MAX_AGE_DAYS is taken again, and stderr says why (the policy is
    # under test here, the measurement was above: the command's run writes today's figures)
    fresh = path.read_text()
    data = json.loads(fresh)
    data["calibration"]["date"] = "2020-01-01T00:00:00+00:00"
    path.write_text(json.dumps(data))
    commands: list[list[str]] = []

    def measure(command: list[str], **_: object) -> subprocess.CompletedProcess:
        commands.append(command)
        path.write_text(fresh)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(hardware_cache.subprocess, "run", measure)
    CompileConfig(hardware="auto", pp=2, microbatches=2)
    assert commands == [[sys.executable, "-m", "lynx.calibrate", "--output", str(path)]]
    assert "days old (measured again after 7); measuring (lynx calibrate)" in capfd.readouterr().err
    assert load_hardware_file(path).calibration.date != "2020-01-01T00:00:00+00:00"


def test_generated_op_overhead_is_measured_on_generated_code() -> None:
    """gpt-tiny at seq 4 × 1 run as one compiled stage: its time, less the arithmetic the rates
    price (a few percent of it), per op its generated forward and backward run."""
    from lynx.calibrate.cpu import ReferenceModel, generated_graphs_s, generated_op_overhead_s, generated_ops

    small = ReferenceModel(seq=4, microbatch=1)
    graphs_s = generated_graphs_s(small, in_flight=2, runs=2).seconds
    assert 1e-5 < graphs_s < 5.0
    ops = generated_ops(small)
    assert ops > 100
    # the fastest device HardwareSpec admits (PHYSICAL_RANGES): its arithmetic costs ~nothing
    free = {"matmul_flops": 1e18, "memory_bandwidth": 1e15, "rng_s_per_element": 0.0}
    assert generated_op_overhead_s(small, free, graphs_s) == pytest.approx(graphs_s / ops, rel=1e-3)
    slow = {"matmul_flops": 1e6, "memory_bandwidth": 1e6, "rng_s_per_element": 1e-3}  # priced above any time
    assert generated_op_overhead_s(small, slow, graphs_s) == 0.0


def test_the_tp_link_is_fitted_to_all_reduce_times() -> None:
    """α + n/β through the ladder's times, recovered exactly from exact times; the link prices
    those all-reduces back (lynx.planner.cost.allreduce_time) for 2 and for 4 ranks."""
    from lynx.calibrate.allreduce import LADDER_BYTES, allreduce_link, fit_allreduce
    from lynx.calibrate.tp_stage import per_collective_s
    from lynx.planner.cost import allreduce_time

    times = [180e-6 + n / 2.5e9 for n in LADDER_BYTES]
    link = fit_allreduce(LADDER_BYTES, times)
    assert link.alpha_s == pytest.approx(90e-6) and link.beta_bytes_per_s == pytest.approx(2.5e9)
    assert [allreduce_time(n, 2, link) for n in LADDER_BYTES] == pytest.approx(times)
    four = fit_allreduce(LADDER_BYTES, times, world=4)
    assert [allreduce_time(n, 4, four) for n in LADDER_BYTES] == pytest.approx(times)
    # per size, the median over the repeats; each repeat fitted alone for the spread
    repeats = [[t * f for t in times] for f in (1.0, 1.5, 0.9)]
    median, per_repeat = allreduce_link(repeats)
    assert median.alpha_s == pytest.approx(90e-6) and [r.alpha_s for r in per_repeat] == pytest.approx(
        [90e-6, 135e-6, 81e-6])
    # times on a line with a negative intercept (noise at the small sizes): through the origin
    # instead, never a negative α; times falling with size: never a β ≤ 0
    through_origin = fit_allreduce([1000, 2000, 4000], [1e-6, 3e-6, 7e-6])
    assert through_origin.alpha_s == 0.0 and through_origin.beta_bytes_per_s > 0
    flat = fit_allreduce([1000, 2000], [5e-4, 4e-4])
    assert flat.alpha_s > 0 and flat.beta_bytes_per_s == 1e14   # the fastest β a link may have
    with pytest.raises(Exception, match="2 or more"):
        fit_allreduce([1000], [1e-4])
    # a sharded stage's excess over its price, per collective it issued; never below zero
    assert per_collective_s(0.010, 0.006, 64) == pytest.approx(62.5e-6)
    assert per_collective_s(0.005, 0.006, 64) == 0.0 and per_collective_s(0.01, 0.0, 0) == 0.0


def _staged_rank(rank, gate, fail, blocks=0):
    """A Staged rank: prepares (or fails to), waits to be let go, reports its CPU (and when
    each of ``blocks`` blocks was let go)."""
    import os
    import time

    from lynx.calibrate.forked import pin_to_core

    if fail:
        raise ValueError("could not prepare")
    from lynx.runtime.sched_slice import thread_slice_s

    cpu = pin_to_core(rank)
    gate.prepared(30.0)
    starts = []
    for _ in range(blocks):
        gate.next_block(rank, 30.0)
        starts.append(time.monotonic())
        gate.block_done()
    return cpu, sorted(os.sched_getaffinity(0)), thread_slice_s(), starts


def test_staged_ranks_prepare_then_measure_once_let_go_each_on_a_core() -> None:
    """lynx.calibrate.forked: ranks forked early say they are prepared and wait; results() lets
    them go. With two CPUs or more each rank is pinned to a CPU of its own, on the short
    scheduler slices a training rank's threads get; a rank that fails preparing says so too
    (nothing waits on it); cancel() ends ranks never let go."""
    import os
    import time

    from lynx.calibrate.forked import Staged
    from lynx.runtime.sched_slice import SHORT_SLICE_S, custom_slices, thread_slice_s

    allowed = sorted(os.sched_getaffinity(0))
    with Staged(_staged_rank, 2, (False, 2), timeout_s=30.0) as staged:
        assert staged.wait_prepared()
        # blocks of runs, each let go by run_block once the one before is done (the calibration's
        # TP stage, one block after each of its repeats)
        assert staged.run_block()
        between = time.monotonic()
        assert staged.run_block()
        items, missing = staged.results()
    got = dict(items)
    assert missing is None and set(got) == {0, 1}
    assert all(got[r][3][0] < between < got[r][3][1] for r in (0, 1))
    if len(allowed) >= 2:
        assert [got[r][:2] for r in (0, 1)] == [(allowed[0], [allowed[0]]), (allowed[1], [allowed[1]])]
    if custom_slices() and thread_slice_s() is not None:
        assert [got[r][2] for r in (0, 1)] == [SHORT_SLICE_S, SHORT_SLICE_S]
    with Staged(_staged_rank, 1, (True,), timeout_s=30.0) as failing:
        assert failing.wait_prepared()
        assert failing.results()[0] == [(0, "rank 0: ValueError: could not prepare")]
    with Staged(_staged_rank, 2, (False,), timeout_s=30.0) as abandoned:
        abandoned.wait_prepared()
    assert not any(p.is_alive() for p in abandoned.procs)
