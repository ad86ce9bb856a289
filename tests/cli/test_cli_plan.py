"""`lynx plan`, `show`, `compare` on the tiny preset; bad input exits 2 with a message."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lynx.cli import app

runner = CliRunner()
TINY = ["gpt-tiny", "--hardware", "cpu-local", "--pp", "2", "-m", "4"]


def test_plan_then_show_writes_table_and_pictures(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", *TINY, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists() and json.loads(out.read_text())["schema_version"] == 1
    result = runner.invoke(app, ["show", str(out), "--picture", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    assert "in windows" in result.output and "stage" in result.output
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "t.svg").stat().st_size > 0


def test_compare_json_lists_every_solver() -> None:
    result = runner.invoke(app, ["compare", *TINY, "--json", "--time-limit", "5"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.output[result.output.index("["):])
    solvers = {r["solver"] for r in records}
    assert {"opt", "heu", "none", "full", "full-block", "selective", "checkmate"} <= solvers
    full = next(r for r in records if r["solver"] == "full")
    assert full["speedup_over_full"] == 1.0
    for r in records:
        if "step_time_s" in r:
            assert {"exposed_recompute_s", "peak_memory_bytes", "fits_budget", "search_time_s"} <= set(r)


def test_bad_input_exits_with_a_message(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    result = runner.invoke(app, ["show", str(bad)])
    assert result.exit_code == 2 and "not valid JSON" in result.output
    result = runner.invoke(app, ["plan", *TINY, "--time-limit", "0", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "time_limit_s must be > 0" in result.output
    result = runner.invoke(app, ["plan", "gpt-tiny", "--hardware", "cpu-local", "--pp", "8", "-m", "8",
                                 "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "only 4 layers" in result.output


def test_compare_lists_errors_in_full_and_fails_when_the_requested_solver_has_no_plan() -> None:
    result = runner.invoke(app, ["compare", *TINY, "-b", "2MiB", "--time-limit", "5"])
    assert result.exit_code == 1, result.output
    assert "the requested solver heu finds no plan" in result.output
    # the whole message, on a line of its own under the table (a table cell clipped it)
    line = next(x for x in result.output.splitlines() if x.startswith("heu: "))
    assert line.endswith("or fewer microbatches in flight") and "Raise memory_budget by at least" in line
    fits = runner.invoke(app, ["compare", *TINY, "-b", "2MiB", "--time-limit", "5", "--solver", "none"])
    assert fits.exit_code == 0, fits.output      # a baseline is scored as it is, over budget or not
    as_json = runner.invoke(app, ["compare", *TINY, "-b", "2MiB", "--time-limit", "5", "--json"])
    assert as_json.exit_code == 1
    bad = runner.invoke(app, ["compare", *TINY, "--solver", "fastest"])
    assert bad.exit_code == 2 and "--solver must be one of" in bad.output


def test_offload_plans_show_their_bytes_and_copy_lanes(tmp_path) -> None:
    """`lynx compare --offload` puts recompute-only HEU and the offload baselines beside HEU and
    says what each stage offloads and how long its copy lanes run; `lynx show` of an offloading
    plan lists offloaded bytes per stage and draws the copy lanes."""
    result = runner.invoke(app, ["compare", *TINY, "--json", "--time-limit", "5", "--offload"])
    assert result.exit_code == 0, result.output
    records = {r["solver"]: r for r in json.loads(result.output[result.output.index("["):])}
    assert {"heu", "heu (no offload)", "offload-all", "offload-modules"} <= set(records)
    moved = records["offload-all"]
    assert moved["offloaded_bytes"][0] > 0 and moved["copy_lanes_s"][0][0] > 0, moved
    assert records["heu (no offload)"]["offloaded_bytes"] == [0, 0]
    table = runner.invoke(app, ["compare", *TINY, "--time-limit", "5", "--offload", "--solver", "none"])
    assert "offloaded per stage" in table.output and "copy lanes" in table.output, table.output
    out = tmp_path / "plan.json"
    assert runner.invoke(app, ["plan", *TINY, "--offload", "--solver", "offload-all", "-o", str(out)]).exit_code == 0
    shown = runner.invoke(app, ["show", str(out), "--picture", str(tmp_path / "t")])
    assert shown.exit_code == 0, shown.output
    assert "offloaded to host memory per microbatch: stage 0" in shown.output
    assert "h2d" in shown.output and (tmp_path / "t.svg").stat().st_size > 0


def test_auto_plans_each_rank_on_its_share_of_this_machine(monkeypatch, capsys) -> None:
    """`lynx plan --hardware auto` is this machine: 4 ranks on 2 cores get half a core each (as
    examples/train_gpt.py plans), the tp link's host work included; presets stay as they are."""
    from lynx.cli.common import compile_config
    from lynx.cli.plan_cmd import _shared_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    config = compile_config(2, 1, 2, 4, "1f1b", 1, None, "cpu-local", "adamw", "heu", 5.0, None, 0, 100)
    shared = _shared_cores(config).hardware_spec()
    assert shared.name == "cpu-local-4on2" and "4 ranks (pp 2 × tp 2 × dp 1)" in capsys.readouterr().err
    base = config.hardware_spec()
    assert shared.links["tp"].alpha_s == 2 * base.links["tp"].alpha_s and shared.links["pp"] == base.links["pp"]
    two = compile_config(1, 1, 2, 4, "1f1b", 1, None, "cpu-local", "adamw", "heu", 5.0, None, 0, 100)
    assert _shared_cores(two) is two   # a core per rank: nothing to share
