"""Fixtures for the vLLM tests: a test-only vLLM environment and in-process engines.

The environment is set for the tests of this package only (`vllm_environment`, a package-scoped
autouse fixture, restored after the package's last test so that no later test sees it): the
in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, 2-4 s to start instead of 20-30 s) and a fresh
cache root, so that a stale `modelinfos/` entry or compile cache cannot hide a broken plugin. vLLM
reads both lazily (when an engine starts), so they only have to be set before the first engine.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="package", autouse=True)
def vllm_environment():
    """Set the vLLM variables for tests/serving, yield the fresh cache root, then restore and remove it."""
    root = Path(tempfile.mkdtemp(prefix="attnres-vllm-cache-"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
        patch.setenv("VLLM_CACHE_ROOT", str(root))
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="package")
def vllm_cache_root(vllm_environment) -> Path:
    """The package's vLLM cache root (fresh per session, removed after the package's last test)."""
    return vllm_environment


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """`make(name, **config_overrides)`: a tiny random AttnRes checkpoint with the built-in tokenizer."""
    from attnres.serving.random_model import write_tiny_checkpoint

    made = {}

    def make(name: str, seed: int = 0, **overrides) -> Path:
        if name not in made:
            made[name] = write_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=seed, **overrides)
        return made[name]

    return make

