#!/usr/bin/env bash
# One prepared run for a GPU machine (one H200): install, then the transformers benchmark at a large
# size in bfloat16 and the kernel timing. Writes the tables to ${OUT:-bench-gpu-out}/.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench-gpu-out}
mkdir -p "$out"
python -m pip install -q -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python bench/gpu/bench_kernel.py | tee "$out/kernel.md"
python bench/bench_transformers.py --device cuda --dtypes bfloat16 --hidden-size 4096 --num-hidden-layers 32 \
  --num-attention-heads 32 --num-key-value-heads 8 --intermediate-size 11008 --block-size 4 \
  --prefill-tokens 2048 --decode-batches 1 32 --repeats 5 | tee "$out/transformers.md"
