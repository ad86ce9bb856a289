"""Suite-wide settings: which tests are ``slow``.

``pytest -m "not slow" tests`` is the fast loop: it leaves out what starts processes (the
multi-process runtime, the training example under torchrun, the optimizers' world-size runs,
network namespaces) and the whole-pipeline peak-memory runs. The full suite (the README's
command, and CI) runs everything. Marking by path here keeps the rule in one place; a new test
in these files or folders is slow by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SLOW = (
    "tests/runtime/",
    "tests/examples/",
    "tests/test_peak_prediction.py",
    "tests/test_testbed.py",
    "tests/test_process_group_guard.py",
    "tests/optim/test_lion.py::test_world_",
    "tests/optim/test_demo.py::test_world_",
    "tests/cli/test_cli_inspect_pipe.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        nodeid = rel + item.nodeid[item.nodeid.find("::"):] if "::" in item.nodeid else rel
        if any(nodeid.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)
