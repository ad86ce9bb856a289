"""Suite-wide settings: which tests are ``slow``, and no test touches the user's hardware cache.

``pytest -m "not slow" tests`` is the fast loop: it leaves out what starts processes (the
multi-process runtime, the training example under torchrun, the optimizers' world-size runs,
network namespaces) and the whole-pipeline peak-memory runs. The full suite (the README's
command, and CI) runs everything. Marking by path here keeps the rule in one place; a new test
in these files or folders is slow by default.

``hardware="auto"`` keeps this host's measurement in the user's cache folder; the suite points
that folder at a temporary one (subprocesses inherit it), so a test never picks up — or leaves
behind — a real measurement. Tests plan with the fixed ``cpu-local`` preset unless they test
``auto`` itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SLOW = (
    "tests/runtime/",
    "tests/examples/",
    "tests/test_peak_prediction.py",
    "tests/test_testbed.py",
    "tests/test_process_group_guard.py",
    "tests/test_planning_imports.py",
    "tests/test_train_your_model_doc.py",
    "tests/optim/test_lion.py::test_world_",
    "tests/optim/test_demo.py::test_world_",
    "tests/cli/test_cli_inspect_pipe.py",
    "tests/test_calibrate.py::test_auto_",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        nodeid = rel + item.nodeid[item.nodeid.find("::"):] if "::" in item.nodeid else rel
        if any(nodeid.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def private_hardware_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lynx-cache")
    old = os.environ.get("LYNX_CACHE_DIR")
    os.environ["LYNX_CACHE_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("LYNX_CACHE_DIR", None)
    else:
        os.environ["LYNX_CACHE_DIR"] = old
