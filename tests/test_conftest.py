"""How tests/conftest.py splits the suite between `make test`'s two workers: one scope per module, the
multi-rank modules as one scope that runs first, the modules of the shared server as one scope, and a
module using the `multirank` fixture or the shared server unlisted is refused (it would start every
multi-rank engine, or the server, a second time)."""

from types import SimpleNamespace

import pytest

from tests import conftest


def item(nodeid: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures))


def test_each_module_is_a_scope_and_the_multirank_modules_are_one():
    assert conftest.scope("tests/serving/test_quantized.py::test_vllm_serves_w8a8_on_cpu[x]") == \
        "tests/serving/test_quantized.py"
    assert conftest.scope("tests/serving/test_lora.py::TestX::test_y[a::b]") == "tests/serving/test_lora.py"
    assert {conftest.scope(f"{module}::test_a[x]") for module in conftest.MULTIRANK_MODULES} == {"multirank"}
    assert {conftest.scope(f"{module}::test_b") for module in conftest.SHARED_SERVER_MODULES} == {"shared-server"}


def test_the_multirank_modules_run_first_and_the_rest_keep_their_order():
    pp, tp = conftest.MULTIRANK_MODULES[1:]
    items = [item("tests/bench/test_a.py::test_1"), item(f"{tp}::test_2", "multirank"),
             item("tests/serving/test_server.py::test_3"), item(f"{pp}::test_4"), item(f"{pp}::test_5", "multirank")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid.rsplit("_", 1)[1] for i in items] == ["2", "4", "5", "1", "3"]


def test_a_module_using_multirank_unlisted_is_refused_naming_it():
    items = [item("tests/serving/test_new_parallel.py::test_1", "multirank")]
    with pytest.raises(pytest.UsageError, match=r"test_new_parallel\.py.*add them to MULTIRANK_MODULES"):
        conftest.pytest_collection_modifyitems(None, items)


def test_a_module_sharing_the_server_unlisted_is_refused_naming_it():
    items = [item("tests/serving/test_new_client.py::test_1", "server")]
    items[0].module = SimpleNamespace(SHARED_SERVER=True)
    with pytest.raises(pytest.UsageError, match=r"test_new_client\.py.*add them to SHARED_SERVER_MODULES"):
        conftest.pytest_collection_modifyitems(None, items)
    items[0].module.SHARED_SERVER = False                                 # a module server of its own: allowed
    conftest.pytest_collection_modifyitems(None, items)


def test_every_listed_module_exists_and_uses_the_fixture():
    root = conftest.Path(conftest.__file__).parents[1]
    for module in conftest.MULTIRANK_MODULES:
        assert "(multirank" in (root / module).read_text(), f"{module} does not use the multirank fixture"
    for module in conftest.SHARED_SERVER_MODULES:
        assert "\nSHARED_SERVER = True\n" in (root / module).read_text(), f"{module} does not set SHARED_SERVER"
