"""Fixtures for the vLLM tests: a test-only vLLM cache root and in-process engines.

The environment is set here, before anything imports vLLM: the in-process engine
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, 2-4 s to start instead of 20-30 s) and a fresh cache root per
session, so that a stale `modelinfos/` entry or compile cache cannot hide a broken plugin.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_CACHE_ROOT = Path(tempfile.mkdtemp(prefix="attnres-vllm-cache-"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_CACHE_ROOT"] = str(_CACHE_ROOT)
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_cache_root() -> Path:
    """The session's vLLM cache root (fresh per session, removed at exit)."""
    return _CACHE_ROOT


@pytest.fixture(scope="session")
def real_default_model() -> tuple[Path, Path]:
    """`(cache root, folder)` of the server's real default (SmolLM2-135M-Instruct as AttnRes), built from the
    package registry into the cache directory `make serve` uses: built once, then reused (by later
    sessions and by `make serve` too)."""
    from attnres.serving.default_model import ensure_default_model
    from attnres.serving.defaults import cache_dir

    root = cache_dir()
    return root, ensure_default_model(root, log=print)


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

