#!/usr/bin/env bash
# Wheels the lent H200 lacks for Lynx, downloaded here and carried there (docs/gpu.md).
#
# The device's image has torch, networkx, numpy, typer, rich, matplotlib, pandas and absl-py,
# but not pydantic (lynx.config, lynx.plan) nor OR-tools (OPT, checkmate, HEU's exact
# fallback), and nothing can be installed there from a registry. This downloads CPython 3.12
# manylinux x86-64 wheels of the versions in this checkout's .venv into .whl/ (ignored by git
# through .git/info/exclude); a `run` then carries ".whl" and installs them into /tmp/site.
#
#   bash scripts/gpu_wheels.sh            # ~32 MiB into .whl/
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exclude=.git/info/exclude
if [ -d .git ] && ! grep -qx '/.whl/' "$exclude" 2>/dev/null; then
    echo '/.whl/' >> "$exclude"
fi
# pydantic and what it needs beyond the image; OR-tools and its pins (protobuf 6.33.x).
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions ortools immutabledict protobuf)
pins=$("$PYTHON" - "${packages[@]}" <<'EOF'
import importlib.metadata as md, sys
print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
EOF
)
rm -rf .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
ls -1 .whl
du -sh .whl
