"""The API key on every route: `attnres-serve` adds `RequireAPIKey` to vLLM's server (`--middleware`).

vLLM's own `--api-key` check (`AuthenticationMiddleware`) guards only the `/v1`, `/v2`, `/inference`
and `/cohere` prefixes: `POST /invocations` generates text without the key, and `/tokenize`,
`/detokenize`, `/tokenizer_info`, `/metrics`, `/version`, `/load`, the OpenAPI pages and the rest
answer anyone. `RequireAPIKey` applies vLLM's own token check to every path but the health checks
(`OPEN_PATHS`, which load balancers poll without credentials). It reads the key where vLLM does
(`--api-key`, else `VLLM_API_KEY`) from the app's own arguments, so every API-server process of a
`--api-server-count` deployment enforces it; with no key set it does nothing.
"""

import hashlib

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm import envs
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

OPEN_PATHS = frozenset({"/health", "/ping"})
MIDDLEWARE = f"{__name__}.RequireAPIKey"


def configured_keys(args) -> list[str]:
    """The API keys a vLLM server was started with: `--api-key` (a list), else `VLLM_API_KEY`."""
    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


class RequireAPIKey(AuthenticationMiddleware):
    """vLLM's bearer-token check on every route except `OPEN_PATHS` (and CORS preflight requests)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app, tokens=[])
        self.resolved = False

    def tokens(self, scope: Scope) -> list[bytes]:
        """The hashed keys, read once from the app's parsed arguments (`app.state.args`)."""
        if not self.resolved:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            self.api_tokens = [hashlib.sha256(k.encode("utf-8")).digest() for k in configured_keys(args)]
            self.resolved = True
        return self.api_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if not self.tokens(scope) or path in OPEN_PATHS or self.verify_token(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        response = JSONResponse({"error": "Unauthorized"}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


__all__ = ["MIDDLEWARE", "OPEN_PATHS", "RequireAPIKey", "configured_keys"]
