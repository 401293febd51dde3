"""Fixtures for the vLLM tests: a test-only vLLM environment, tiny checkpoints and the module's server.

The environment is set for the tests of this package only (`vllm_environment`, a package-scoped
autouse fixture, restored after the package's last test so that no later test sees it): the
in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, 2-4 s to start instead of 20-30 s) and a fresh
cache root, so that a stale `modelinfos/` entry or compile cache cannot hide a broken plugin. vLLM
reads both lazily (when an engine starts), so they only have to be set before the first engine.
"""

import contextlib
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


@pytest.fixture(scope="module")
def server_cache(request, tmp_path_factory) -> Path:
    """The module server's own `ATTNRES_CACHE_DIR` (where it builds `builtin:` models); the shared
    server's for a module with `SHARED_SERVER = True`."""
    if getattr(request.module, "SHARED_SERVER", False):
        return request.getfixturevalue("shared_server_cache")
    return tmp_path_factory.mktemp("attnres-cache")


def start_server(args: list[str], cache: Path, key: str | None, env: dict):
    """`ServerProcess` (a context manager) of `attnres-serve ARGS [--api-key KEY]` with `ATTNRES_CACHE_DIR`
    at `cache`, its engine core in its own process as users run it; `api_key` set on it."""
    from attnres.serving.launcher import ServerProcess

    env = {"ATTNRES_CACHE_DIR": str(cache), "VLLM_ENABLE_V1_MULTIPROCESSING": None, **env}
    proc = ServerProcess([*args, *(["--api-key", key] if key else [])], env=env, startup_timeout=600)
    proc.api_key = key
    return proc


@pytest.fixture(scope="module")
def server(request, server_cache):
    """One real `attnres-serve` process per test module, started with the module's `SERVER_ARGS` (or
    `server_args(request)`, for arguments made by fixtures) (and
    `SERVER_ENV`, and `--api-key SERVER_API_KEY` when the module sets one) on a free loopback port, its
    engine core in its own process as users run it; for a module with `SHARED_SERVER = True`, the
    session's `shared_server`. A module's last test may stop it with SIGTERM and check that this
    sufficed; the teardown only cleans up (SIGKILL included) after a failure."""
    if getattr(request.module, "SHARED_SERVER", False):
        yield request.getfixturevalue("shared_server")()
        return
    args = request.module.server_args(request) if hasattr(request.module, "server_args") else request.module.SERVER_ARGS
    with start_server(args, server_cache, getattr(request.module, "SERVER_API_KEY", None),
                      getattr(request.module, "SERVER_ENV", {})) as proc:
        print(f"attnres-serve ({request.module.__name__}) healthy after {proc.startup_seconds:.1f} s")
        yield proc


@pytest.fixture(scope="session")
def shared_server_cache(tmp_path_factory) -> Path:
    """The shared server's `ATTNRES_CACHE_DIR`."""
    return tmp_path_factory.mktemp("attnres-shared-cache")


@pytest.fixture(scope="session")
def shared_server(shared_server_cache):
    """`get()`: the one `attnres-serve` of `tests.support.shared_server` (the tiny random model behind a
    key) for the modules with `SHARED_SERVER = True`: started on first use, and again when a module's
    last test has stopped it; stopped at the end of the session."""
    from tests.support import shared_server

    with contextlib.ExitStack() as stack:
        running = []

        def get():
            if not running or running[-1].proc is None or running[-1].proc.poll() is not None:   # stopped
                proc = stack.enter_context(start_server(shared_server.ARGS, shared_server_cache,
                                                        shared_server.API_KEY, {}))
                print(f"attnres-serve (shared) healthy after {proc.startup_seconds:.1f} s")
                running.append(proc)
            return running[-1]

        yield get


@pytest.fixture(scope="module")
def client(server):
    """The `openai` client of the module's server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=getattr(server, "api_key", None) or "unused",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def multirank(tmp_path_factory):
    """`(results, checkpoint paths)` of every multi-rank engine, run once per session in one subprocess
    (`tests.support.multirank`)."""
    from tests.support import multirank

    return multirank.results(tmp_path_factory.mktemp("multirank"))
