import json

from typer.testing import CliRunner

from lynx.cli import app, main

runner = CliRunner()


def test_inspect_json_schema():
    result = runner.invoke(app, ["inspect", "gpt-tiny", "--json", "--target", "cpu", "--hardware", "cpu-local"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert set(record) == {"model", "target", "dims", "layers", "totals"}
    assert record["target"] == "cpu"
    assert record["dims"] == {"hidden": 64, "heads": 4, "layers": 4, "seq": 32, "microbatch": 1, "dtype": "float32"}
    assert [layer["layer_class"] for layer in record["layers"]] == ["pre"] + ["GPTBlock"] * 4 + ["post"]
    assert set(record["layers"][1]) == {"index", "layer_class", "flops", "saved_bytes", "forward_s", "backward_s"}
    assert record["totals"]["saved_bytes"] == sum(layer["saved_bytes"] for layer in record["layers"])


def test_inspect_table_names_the_target():
    result = runner.invoke(app, ["inspect", "gpt-1.3b", "--microbatch", "2", "--hardware", "a100-80g"])
    assert result.exit_code == 0, result.output
    assert "target cuda" in result.output and "GPTBlock" in result.output and "24" in result.output


def test_inspect_factory(tmp_path, monkeypatch):
    (tmp_path / "factory_mod.py").write_text(
        "import torch\n"
        "def build():\n"
        "    block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())\n"
        "    m = torch.nn.Sequential(*[block() for _ in range(3)])\n"
        "    return m, (torch.randn(4, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = runner.invoke(app, ["inspect", "factory_mod:build", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["dims"]["hidden"] is None and record["dims"]["microbatch"] == 4


def _run_main(monkeypatch, capsys, args):
    monkeypatch.setattr("sys.argv", ["lynx", *args])
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code
    else:
        code = 0
    return code, capsys.readouterr().err


def test_bad_input_is_a_message_not_a_traceback(monkeypatch, capsys):
    for args, needle in [
        (["inspect", "gpt-99b"], "valid presets"),
        (["inspect", "gpt-tiny", "--seq", "-4"], "positive integer"),
        (["inspect", "gpt-tiny", "--hardware", "abacus"], "unknown hardware"),
        (["inspect", "gpt-tiny", "--dtype", "fp8"], "unknown dtype"),
    ]:
        code, err = _run_main(monkeypatch, capsys, args)
        assert code == 2 and needle in err and "Traceback" not in err


def test_a_factory_that_raises_is_one_line(tmp_path, monkeypatch, capsys):
    """Issue 22, finding 6: a factory that raised gave ~50 lines of traceback."""
    (tmp_path / "broken_factory.py").write_text("def build():\n    raise ValueError('no weights here')\n")
    (tmp_path / "broken_import.py").write_text("import math\nraise RuntimeError('at import')\n")
    for spec, needle in [
        (f"{tmp_path}/broken_factory.py:build",
         f"the model factory '{tmp_path}/broken_factory.py:build' raised ValueError: no weights here "
         f"(at {tmp_path}/broken_factory.py:2)"),
        (f"{tmp_path}/broken_import.py:build", "raised RuntimeError: at import"),
    ]:
        code, err = _run_main(monkeypatch, capsys, ["inspect", spec])
        assert code == 2 and needle in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_inspect_offload_lists_candidates_and_why():
    args = ["inspect", "gpt-tiny", "--seq", "512", "--microbatch", "8", "--hardware", "h100-sxm", "--offload"]
    record = json.loads(runner.invoke(app, [*args, "--json"]).output)
    found = record["offload_candidates"]
    assert {c["verdict"] for c in found} == {"offload first", "recompute first"}
    matmul = next(c for c in found if c["node"] == "matmul")
    assert matmul["verdict"] == "offload first" and "dearest per byte" in matmul["why"] and matmul["copy_s"] > 0
    assert all(c["saved_bytes"] > 0 for c in found)
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "offload candidates" in table.output and "never offloaded" in table.output
