"""API keys: `--api-key KEY` (or HYBRIDSERVE_API_KEY) on `serve` and `proxy`.

With a key, every route but the open ones (`/health`) needs `Authorization: Bearer KEY`; a
missing or wrong key is a 401 in the OpenAI error shape with `WWW-Authenticate: Bearer`. The
key is compared in constant time (`hmac.compare_digest`). The middleware answers before the
route runs, so an unauthenticated request body is never read or parsed.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection
from typing import Any

from hybridserve.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


def bearer_header(key: str | None) -> dict[str, str]:
    """The request header that carries `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class BearerAuth:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>` (see the module docstring)."""

    def __init__(self, app: Any, key: str, open_paths: Collection[str] = OPEN_PATHS) -> None:
        if not key:
            raise ValueError("an empty API key")
        self.app = app
        self.key = key.encode()
        self.open_paths = frozenset(open_paths)

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request's Authorization header carries the key."""
        value = next((v for n, v in headers if n.lower() == b"authorization"), b"")
        scheme, _, token = value.strip().partition(b" ")
        ok = hmac.compare_digest(token.strip(), self.key)  # compared even when the scheme is wrong
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.allowed(scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "a valid API key is required: send 'Authorization: Bearer <key>'",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)
