"""Planning stays out of ``torch.distributed``, and the planning core imports without torch.

Both run in a fresh interpreter, where ``sys.modules`` starts empty. ``tests/test_layout.py``
reads the same property statically; these run it.

torch itself imports ``torch.distributed`` (``import torch`` does on torch 2.13, and
``torch.export`` imports ``torch.distributed.nn.functional`` through ``torch._dynamo``), so
what Lynx can promise is that no module of its own imports it while planning: every ``import``
statement a ``lynx`` module executes goes through ``builtins.__import__`` and every lazy import
through ``importlib.import_module``, and both are watched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WATCH = textwrap.dedent("""
    import builtins, importlib, json, sys

    seen = []

    def _distributed(name, fromlist):
        return name == "torch.distributed" or name.startswith("torch.distributed.") or (
            name == "torch" and "distributed" in (fromlist or ()))

    def _note(importer, name, fromlist=()):
        if importer.split(".")[0] == "lynx" and _distributed(name, fromlist):
            seen.append(f"{importer} imports {name}")

    _import, _import_module = builtins.__import__, importlib.import_module

    def _watched_import(name, globals=None, locals=None, fromlist=(), level=0):
        _note((globals or {}).get("__name__", ""), name, fromlist)
        return _import(name, globals, locals, fromlist, level)

    def _watched_import_module(name, package=None):
        _note(sys._getframe(1).f_globals.get("__name__", ""), name)
        return _import_module(name, package)

    builtins.__import__, importlib.import_module = _watched_import, _watched_import_module

    from lynx.cli import main

    sys.argv = ["lynx", "plan", "gpt-tiny", "--pp", "2", "-m", "4", "--hardware", "cpu-local",
                "-b", "12MiB", "-o", sys.argv[1]]
    try:
        main()
    except SystemExit as done:
        assert not done.code, done.code
    planning = list(seen)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "lynx")
    import lynx.optim  # works with process groups: the watch must see it import torch.distributed
    print(json.dumps({"planning": planning, "loaded": loaded, "optim": seen[len(planning):]}))
""")

# torch made unimportable: a meta-path finder ahead of every other refuses it
BLOCK_TORCH = textwrap.dedent("""
    import importlib, pkgutil, sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("the blocker let torch through")

    imported = []
    for package in ("lynx.planner", "lynx.solvers"):
        root = importlib.import_module(package)
        imported.append(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            importlib.import_module(info.name)
            imported.append(info.name)

    from lynx.solvers import solve
    from lynx.solvers.synthetic import make_uniform_problem

    result = solve("heu", make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=1.0))
    assert result.status == "HEURISTIC", result.status
    print(len(imported), sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
""")


def test_planning_a_preset_with_the_cli_never_imports_torch_distributed(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-c", WATCH, str(plan)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan.exists(), "the CLI wrote no plan"
    assert report["planning"] == [], f"lynx imported torch.distributed while planning: {report['planning']}"
    assert "lynx.process_group_guard" not in report["loaded"]
    assert not [m for m in report["loaded"] if m.startswith(("lynx.runtime", "lynx.optim"))], report["loaded"]
    # the watch is live: lynx.optim's own imports of torch.distributed are caught
    assert any(line.startswith("lynx.optim.") for line in report["optim"]), report["optim"]


def test_planner_and_solvers_import_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    count, torch_modules = done.stdout.split(maxsplit=1)
    assert int(count) > 30, done.stdout
    assert torch_modules.strip() == "[]"
