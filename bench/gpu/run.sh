#!/usr/bin/env bash
# One prepared run for one GPU (sized for an H200, under 10 minutes): the Triton depth-attention
# kernels checked against the torch path and timed against their byte-count floor, then AttnRes vs
# the same-size Llama in transformers (bfloat16, eager and compiled), and in vLLM where vLLM is
# installed. Every step's table goes to ${OUT:-bench-gpu-out}/<step>.md and is printed; the script
# goes on after a failed step and exits 1 at the end, naming the steps that failed.
#
#   bash bench/gpu/run.sh
#
# Nothing is installed: the machine needs torch (CUDA), triton and transformers (>= 5.16.1), and
# runs this checkout in place (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python=${PYTHON:-python3}
failed=()
start=$SECONDS

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep its output, note a failure
  local name=$1 limit=$2
  shift 2
  echo "## $name"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.md"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "**TIMED OUT after ${limit} s**" | tee -a "$out/$name.md"
    echo "**FAILED: $name (exit $rc)**" | tee -a "$out/$name.md"
    failed+=("$name")
  fi
  echo "(${name}: $((SECONDS - start)) s since the start)"
  echo
}

step gpu 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
step versions 40 "$python" -c "import torch, transformers, triton
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__, 'triton',
      triton.__version__)
assert torch.cuda.is_available(), 'torch sees no GPU'"
# ~1 min (the kernels compile at first use): the check table, then one site at hidden 4096 (1..16384
# tokens, 1..32 stored sources, bfloat16 and float32 banks), the block store, host time per call
step kernel 150 "$python" bench/gpu/bench_kernel.py
# ~2 min: Llama-3-8B shapes, AttnRes block size 4 (8 blocks), both AttnRes backends vs Llama, eager
step transformers 180 "$python" bench/gpu/bench_models.py
# ~2-3 min: compiled (Inductor, compile time included in the step), 8 layers to bound compile time;
# block size 1 keeps the 32-layer run's bank (up to 9 stored sources per site); decode batch 1
step transformers-compiled 180 "$python" bench/gpu/bench_models.py --compiled --num-hidden-layers 8 \
  --block-size 1 --prefill-tokens 1024 --decode-batches 1 --repeats 3
left=$((570 - (SECONDS - start)))   # the whole run stays under the device's 10-minute limit
if ! "$python" -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM is not installed on this machine: its ratio is not measured." | tee "$out/vllm.md"
elif [ "$left" -lt 60 ]; then
  echo "Not enough time left for vLLM (${left} s): its ratio is not measured." | tee "$out/vllm.md"
else
  step vllm "$left" "$python" bench/bench_vllm.py --dtype bfloat16 --hidden-size 2048 --num-hidden-layers 16 \
    --num-attention-heads 16 --num-key-value-heads 4 --intermediate-size 8192 --prompts 32 --new-tokens 64 \
    --repeats 3 --kv-cache-bytes $((8 << 30)) --skip-transformers
fi

echo "total: $((SECONDS - start)) s"
if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED steps: ${failed[*]} (see $out/)"
  exit 1
fi
echo "all steps passed; tables in $out/"
