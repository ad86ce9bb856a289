#!/usr/bin/env bash
# Moves constraints.txt (what the suite runs with) to the newest releases pyproject.toml's
# ranges admit: a fresh venv in .venv-update installs Lynx's dev extra without constraints,
# runs the suite there, and only if it passes writes the new constraints.txt. Then review
# `git diff constraints.txt`, commit it on its own with the suite's figures.
#
#   bash scripts/update_constraints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-update
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q "torch==$(sed -n 's/^torch==//p' constraints.txt)+cpu" 2>/dev/null \
    || "$venv/bin/python" -m pip install -q "torch==$(sed -n 's/^torch==//p' constraints.txt)"
"$venv/bin/python" -m pip install -q -e ".[dev]"
"$venv/bin/python" -m pytest -q tests
{
    sed -n '1,3p' constraints.txt
    "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^#' | sed 's/+cpu$//'
} > constraints.txt.new
mv constraints.txt.new constraints.txt
rm -rf "$venv"
git diff --stat constraints.txt
