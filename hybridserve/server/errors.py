"""The OpenAI error shape, shared by the server and the proxy.

Every error answer of both is `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status. This module imports neither the engine nor JAX, so that the proxy stays light.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

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


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Answer every error of `app` in the OpenAI shape: its own APIErrors, HTTP errors (404,
    405, ...), and anything unexpected (500, logged)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return APIError(err.status_code, str(err.detail), kind, headers=err.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal error: {type(err).__name__}", "internal_error").response()
