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
    "tests/test_calibrate.py::test_cli_calibrate_",   # checks the file's one measurement: test_auto_'s
)


# The files that take longest (worker seconds, measured near-quietly with --durations: 2 workers,
# at ee579b9), longest first. The two xdist workers take files in collection order (pyproject's
# addopts turn off xdist's default reordering, which put the most *numerous* files first and so
# the long one-test files last): longest first, the workers end within about one short file of
# each other instead of one idling while the other runs a minute-long file. Only the order changes.
LONGEST_FIRST = (
    "tests/runtime/test_tp_pipeline.py",              # 93 s
    "tests/runtime/test_user_pipeline.py",            # 84
    "tests/examples/test_train_gpt_launches.py",      # 39
    "tests/test_train_your_model_doc.py",             # 37
    "tests/examples/test_train_gpt.py",               # 34
    "tests/runtime/test_runtime_pipeline.py",         # 31
    "tests/test_calibrate.py",                        # 30
    "tests/runtime/test_user_pipeline_failures.py",   # 19
    "tests/test_doctests.py",                         # 18
    "tests/test_gpu_check.py",                        # 17
    # ~13 s of it waits on rate-limited links, lynx.testbed's examples included; not moved up
    # beside the TP worlds: their ranks run in lockstep, pinned a core each, and slowed there
    "tests/test_testbed.py",                          # 29
    "tests/test_profile.py",                          # 12
    "tests/test_rewrite_plans.py",                    # 12
    "tests/test_rewrite.py",                          # 11
    "tests/test_process_group_guard.py",              # 8
    "tests/test_planning_imports.py",                 # 7
    "tests/test_offload_runtime.py",                  # 7
    "tests/test_profile_cache.py",                    # 6
    "tests/test_graph.py",                            # 5
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = _rel(item)
        nodeid = rel + item.nodeid[item.nodeid.find("::"):] if "::" in item.nodeid else rel
        if any(nodeid.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)
    # the long files first, then the other files that start processes, then the rest; stable:
    # every file's tests stay together and in their order
    items.sort(key=lambda item: _file_rank(_rel(item)))


def _rel(item: pytest.Item) -> str:
    path = Path(str(item.path)).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def _file_rank(rel: str) -> int:
    if rel in LONGEST_FIRST:
        return LONGEST_FIRST.index(rel)
    starts_processes = any(rel.startswith(prefix.split("::")[0]) for prefix in SLOW)
    return len(LONGEST_FIRST) + (0 if starts_processes else 1)


# What the ranks of the suite's worlds import besides torch and Lynx: a transformers Llama (the
# user-loop, TP and guide worlds: ~2 CPU-s a rank, ~10 ranks). The fork server each worker starts
# (lynx.testing.world, tests/prestarted.py) imports it once instead; skipped without transformers.
RANKS_IMPORT = ("transformers", "transformers.models.llama.modeling_llama")


@pytest.fixture(autouse=True, scope="session")
def ranks_preload() -> None:
    """Before the worker's first world (a fixture, not at import: the xdist controller, which
    loads this file too, starts no world and need not import torch)."""
    from lynx.testing import preload

    preload(*RANKS_IMPORT)


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
