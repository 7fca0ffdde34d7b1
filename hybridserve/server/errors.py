"""The OpenAI error shape, shared by the server and the proxy.

Every error answer of both is `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status. This module imports neither the engine nor JAX, so that the proxy stays light.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from hybridserve.server import protocol as P


class APIError(Exception):
    """An error answered with the OpenAI error body and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = P.ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def body(self) -> dict:
        """The JSON body, `{"error": {...}}`."""
        return P.ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        """The error as a JSON response with its status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
