#!/usr/bin/env bash
# Creates .venv and installs Lynx with its dev extra. The CPU build of torch is installed
# first and pinned, so the range in pyproject.toml never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
