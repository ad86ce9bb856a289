#!/usr/bin/env bash
# Creates .venv and installs Lynx with its dev extra, at the versions the suite runs with
# (constraints.txt; the package itself keeps its ranges in pyproject.toml).
#
# torch first, as its CPU build: from the indexes pip is configured with where one offers
# torch==2.13.0+cpu, else from PyTorch's CPU index (download.pytorch.org). Where neither is
# reachable it says so and installs torch==2.13.0 from the default index: on Linux x86-64 that
# is the CUDA build, several GB, which runs the suite just as well.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.13.0
python3 -m venv .venv
pip=(.venv/bin/python -m pip)
"${pip[@]}" install -q --upgrade pip >/dev/null
if "${pip[@]}" install -q "torch==$TORCH+cpu" 2>/dev/null; then
    :
elif "${pip[@]}" install -q --timeout 30 --retries 1 --index-url https://download.pytorch.org/whl/cpu \
        "torch==$TORCH+cpu" 2>/dev/null; then
    echo "install.sh: torch $TORCH (CPU build) from download.pytorch.org/whl/cpu"
else
    echo "install.sh: no CPU build of torch $TORCH is reachable; installing torch==$TORCH from the default" \
         "index (on Linux x86-64 the CUDA build, several GB)" >&2
    "${pip[@]}" install -q "torch==$TORCH"
fi
"${pip[@]}" install -q -c constraints.txt -e ".[dev]"
