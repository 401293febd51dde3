#!/usr/bin/env bash
# One prepared run for one GPU (sized for an H200; under 9 minutes in all): the Triton depth-attention
# kernels checked against the torch path and timed against their byte-count floor, then AttnRes vs the
# same-size Llama in transformers (bfloat16; eager, and compiled with CUDA graphs), and in vLLM where
# vLLM is installed. Every timing follows the rules of bench/common.py: fresh inputs per repeat shared
# by all models, a rotating running order, equal token counts checked, and an A/A control (a second
# Llama with the same weights; the Triton kernel timed twice) printed next to every ratio.
#
#   bash bench/gpu/run.sh                 # tables in $OUT (default bench-gpu-out/), one file per step
#   DRY_RUN=1 bash bench/gpu/run.sh       # the same steps at toy sizes on a CPU (Triton's interpreter)
#   STEPS="env kernel" bash bench/gpu/run.sh   # some of the steps only
#
# Each step runs under its own time limit, capped by what is left of the whole run's budget, and the
# run goes on after a failed or timed-out step; its table (with the partial rows of a timed-out step)
# goes to $OUT/<step>.md: env, kernel, transformers, transformers-compiled, vllm and summary (6 files).
# The exit status is 1 when a step failed, and summary.md names it. Nothing is installed: the machine
# needs torch (CUDA), triton and transformers (>= 5.16.1), and runs this checkout in place (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python=${PYTHON:-python3}
budget=${BUDGET_S:-530}   # the whole run's limit, in seconds: under 9 minutes with the final summary
steps=" ${STEPS:-env kernel transformers transformers-compiled vllm} "
failed=()
start=$SECONDS

if [ "${DRY_RUN:-0}" = 1 ]; then   # toy sizes on the CPU, for the tests: every step, every code path but CUDA
  export TRITON_INTERPRET=1
  toy=(--device cpu --hidden-size 64 --num-hidden-layers 2 --num-attention-heads 2 --num-key-value-heads 1
       --intermediate-size 128 --vocab-size 256 --block-size 1)
  kernel=(--device cpu --hidden-size 64 --tokens 1 4 --sources 0 3 --iters 2 --rounds 2)
  models=("${toy[@]}" --prefill-tokens 8 --prompt-tokens 4 --new-tokens 2 --decode-batches 1 --repeats 2)
  compiled=("${toy[@]}" --prompt-tokens 4 --new-tokens 2 --decode-batches 1 --repeats 2 --build-order forward)
else
  kernel=()
  # Llama-3-8B shapes, block size 4 (8 blocks); 16 repeats: 8 per build order, 4 runners each first twice
  models=(--new-tokens 16 --repeats 16)
  # 8 layers bound the compile time; block size 1 keeps the 32-layer bank's depth (up to 9 sources a site);
  # one build order: models built afresh would be compiled afresh, which the run's time limit has no room for
  compiled=(--num-hidden-layers 8 --block-size 1 --decode-batches 1 32 --new-tokens 32 --repeats 12
            --build-order forward)
fi

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep its output, note a failure
  local name=$1 limit=$2
  shift 2
  [[ $steps == *" $name "* ]] || return 0
  local left=$((budget - (SECONDS - start)))
  [ "$limit" -gt "$left" ] && limit=$left
  echo "## $name"
  if [ "$limit" -lt 20 ]; then
    echo "**SKIPPED: $name: ${left} s left of the run's ${budget} s**" | tee "$out/$name.md"
    failed+=("$name")
    return
  fi
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.md" 2>"$out/.$name.err"
  local rc=$?
  cat "$out/$name.md"
  if [ "$rc" -ne 0 ]; then
    tail -n 25 "$out/.$name.err" | sed 's/^/    /' | tee -a "$out/$name.md"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "**TIMED OUT after ${limit} s**" | tee -a "$out/$name.md"
    echo "**FAILED: $name (exit $rc)**" | tee -a "$out/$name.md"
    failed+=("$name")
  fi
  rm -f "$out/.$name.err"
  echo "(${name}: $((SECONDS - start)) s since the start)"
  echo
}

environment() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  fi
  lscpu | grep -E '^(Model name|CPU\(s\)):' || true
  echo "AMX bfloat16: $(grep -qo amx_bf16 /proc/cpuinfo && echo yes || echo no)"
  "$python" -c "import torch, transformers, triton
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__, 'triton',
      triton.__version__)
import os
assert torch.cuda.is_available() or os.environ.get('DRY_RUN') == '1', 'torch sees no GPU'"
}

export python
export -f environment
step env 30 bash -c environment
# ~1 min (the kernels compile at first use): the check table, then one site at hidden 4096 (1..16384
# tokens, 1..32 stored sources, bfloat16 and float32 banks), the block store, host time per call
step kernel 120 "$python" bench/gpu/bench_kernel.py "${kernel[@]}"
# ~2.5 min: three 8B-shape models built on the GPU in each build order, prefill 2048 and decode batches 1
# and 32, eager
step transformers 190 "$python" bench/gpu/bench_models.py "${models[@]}"
# ~3 min, most of it compiling (CUDA graphs, one graph per decode batch size and model)
step transformers-compiled 200 "$python" bench/gpu/bench_models.py --compiled "${compiled[@]}"
vllm_step() {  # vLLM where it is installed (the GPU machine this was prepared for has none)
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "Dry run: the vLLM step is not run (bench/bench_vllm.py has its own test)." | tee "$out/vllm.md"
  elif ! "$python" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM is not installed on this machine: the vLLM step is skipped (its ratio is not measured)." \
      | tee "$out/vllm.md"
  else
    # prefix caching off, three engines (AttnRes, Llama, Llama A/A), rotating order, both build orders (the A/A
    # mirrors the subject's position only across the two), 6 pairs each: 12 in all (the rule's 10 or more)
    step vllm 200 "$python" bench/bench_vllm.py --dtype bfloat16 --hidden-size 2048 --num-hidden-layers 16 \
      --num-attention-heads 16 --num-key-value-heads 4 --intermediate-size 8192 --prefill-tokens 4096 \
      --decode-batches 1 32 --long-decode-batches --new-tokens 32 --repeats 12 --build-order both \
      --kv-cache-bytes $((8 << 30)) --no-kv-profile
  fi
}
[[ $steps == *" vllm "* ]] && vllm_step

{
  echo "total: $((SECONDS - start)) s of a ${budget} s budget"
  if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED steps: ${failed[*]} (see their files in $out/)"
  else
    echo "all steps passed; tables in $out/"
  fi
} | tee "$out/summary.md"
[ ${#failed[@]} -eq 0 ]
