#!/usr/bin/env bash
# The README's main job: set up, then train a tiny GPT for real on this machine's CPUs with
# 2 pipeline stages, the DeMo compressed optimizer and a Lynx HEU plan under a 12 MiB budget
# that forces recomputation (stage 0 keeps 16.9 MiB without it), planned for this machine as
# `lynx calibrate` measures it (--hardware auto: measured on the first run, ~15 s, then cached);
# end with the plan's predicted vs the run's measured step time and memory, and every solver
# and baseline on the same model and budget. A few minutes on 2 cores. Checkpoints go to a fresh temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
run_dir=$(mktemp -d "${TMPDIR:-/tmp}/lynx-main-job.XXXXXX")
settings=(--model gpt-tiny --seq 64 --microbatch 8 --pp 2 --microbatches 4 --optimizer demo --memory-budget 12MiB)
echo "== training (torchrun, 2 processes, gloo); checkpoints and log in $run_dir"
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 examples/train_gpt.py "${settings[@]}" --hardware auto --solver heu \
    --steps 60 --checkpoint-dir "$run_dir/ckpt" --checkpoint-every 20 --log-json "$run_dir/log.json"
echo "== the same model and budget under every solver and baseline (lynx compare)"
.venv/bin/lynx compare gpt-tiny --seq 64 --microbatch 8 --pp 2 --dp 1 --microbatches 4 --optimizer demo \
    --memory-budget 12MiB --hardware auto --time-limit 10
