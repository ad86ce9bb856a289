"""Every docstring example under ``lynx/`` runs, as the reader would type it."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lynx

ALL = sorted(m.name for m in pkgutil.walk_packages(lynx.__path__, "lynx."))
# lynx.testbed's examples run ranks over rate-limited links, mostly waiting on them: they run in
# tests/test_testbed.py with the other tests that do (one file to schedule: tests/conftest.py)
TESTBED = [name for name in ALL if name.startswith("lynx.testbed")]
MODULES = [name for name in ALL if name not in TESTBED]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    run_docstring_examples(name)


def run_docstring_examples(name: str) -> None:
    """Every docstring example of module ``name``, as the reader would type it."""
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):  # globals: a copy of the module's, as doctest does
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} docstring examples in {name} failed (output above)"
    )
