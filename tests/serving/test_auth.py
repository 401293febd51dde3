"""`RequireAPIKey` (serving/auth.py) on a stand-in app: the key where vLLM reads it (`--api-key`, else
`VLLM_API_KEY`) guards every path but the health checks and CORS preflight requests. The real server's
routes, one by one: tests/serving/test_server.py."""

from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from attnres.serving.auth import RequireAPIKey, configured_keys


async def answer(request):
    return PlainTextResponse("served")


def client(api_key: list[str] | None) -> TestClient:
    """A stand-in server behind the middleware, started with `--api-key` set to `api_key` (None: not given)."""
    app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST", "OPTIONS"])],
                    middleware=[Middleware(RequireAPIKey)])
    app.state.args = SimpleNamespace(api_key=api_key)
    return TestClient(app)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api_key, env_key, key", [(["k1"], None, "k1"), (None, "k2", "k2"), (["k1"], "k2", "k1")])
def test_the_key_from_the_command_line_or_the_environment_guards_every_route(monkeypatch, api_key, env_key, key):
    if env_key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env_key)
    assert configured_keys(SimpleNamespace(api_key=api_key)) == [key]
    server = client(api_key)
    for method, path in [("POST", "/tokenize"), ("GET", "/version"), ("POST", "/invocations"), ("GET", "/metrics")]:
        for given in (None, "wrong", "k2" if key == "k1" else "k1"):
            headers = {"Authorization": f"Bearer {given}"} if given else {}
            assert server.request(method, path, headers=headers).status_code == 401, (method, path, given)
        assert server.request(method, path, headers={"Authorization": f"Bearer {key}"}).text == "served"
    for path in ("/health", "/ping"):
        assert server.get(path).text == "served"
    # A browser's CORS preflight carries no credentials: it reaches vLLM's CORS handling, not a 401.
    preflight = server.options("/v1/completions", headers={"Origin": "http://localhost:3000",
                                                           "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.text == "served"


@pytest.mark.timeout(60)
def test_without_a_key_every_route_is_open(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert configured_keys(SimpleNamespace(api_key=None)) == []
    assert client(None).post("/tokenize").text == "served"
