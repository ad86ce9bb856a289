#!/usr/bin/env bash
# On the lent H200 (the device tool's `run`, carrying ".whl"): install the carried wheels,
# then run benchmarks/gpu_check.py with its report and log under $OUT (docs/gpu.md).
#
#   run(command="bash scripts/gpu_check_device.sh", carry=[".whl"], timeout_s=480)
#
# Extra arguments go to gpu_check.py (e.g. --checks saved_bytes,gradients for a rerun).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/gpu_check_env.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
    2>&1 | tee -a "$out/gpu_check_env.txt"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --device cuda --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
