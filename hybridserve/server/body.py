"""Reading a request body as JSON, for the server and the proxy: size limit, read deadline and
JSON that can be sent on again.

`read_json(request, limit, timeout_s)` answers (as an `APIError`):
  - 413 for a Content-Length over `limit`, at once and with `Connection: close` (nothing of the
    body is read); 413 for a body without Content-Length (chunked) as soon as it passes `limit`,
    without `Connection: close`: the HTTP layer reads and drops the rest (bounded by the body
    timeout, see `listener.py`), so the client finishes sending and reads the answer instead of
    a connection reset;
  - 408 with `Connection: close` when the body is not complete `timeout_s` seconds after the
    route began to read it (a client that never finishes its body);
  - 499 when the client disconnects while sending (nobody reads it; metrics count a 499, not a
    500);
  - 400 for anything that is not strict JSON as the upstreams re-encode it: invalid UTF-8,
    malformed JSON, NaN and Infinity, floats that overflow to infinity (1e400), integers past
    Python's digit limit (5000 digits), nesting past the parser's recursion limit, and strings
    with lone surrogates (`"\\ud800"`: json.loads accepts them, UTF-8 cannot encode them).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from hybridserve.server.errors import APIError


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is too large")
    return value


def encode_json(value: Any) -> bytes:
    """`value` as UTF-8 JSON bytes, or a 400 APIError when it cannot be encoded (lone
    surrogates, NaN or infinity, nesting too deep for the encoder)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as err:
        message = f"the request body has a string that is not valid Unicode: {err.reason}"
        raise APIError(400, message) from err
    except (ValueError, RecursionError) as err:
        raise APIError(400, f"the request body cannot be encoded as JSON: {err}") from err


def parse_json(raw: bytes) -> Any:
    """Strict JSON of a request body (see the module docstring), or a 400 APIError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8: {err}") from err
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except (ValueError, RecursionError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from err
    encode_json(value)  # lone surrogates, nesting the encoder cannot take
    return value


async def read_body(request: Request, limit: int, timeout_s: float | None) -> bytes:
    """The raw body, at most `limit` bytes, read within `timeout_s` seconds (None: no limit);
    413, 408 or 499 as an APIError (see the module docstring)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length header", headers={"Connection": "close"})
        if int(length) > limit:
            raise _too_big(limit, close=False)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_big(limit, close=False)
    except TimeoutError as err:
        raise APIError(
            408,
            f"the request body was not complete within {timeout_s:g} s (--body-timeout)",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from err
    except ClientDisconnect as err:
        raise APIError(499, "the client disconnected while sending the body") from err
    return bytes(body)


async def read_json(request: Request, limit: int, timeout_s: float | None = None) -> Any:
    """The request body as strict JSON (see the module docstring)."""
    return parse_json(await read_body(request, limit, timeout_s))


def _too_big(limit: int, close: bool) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (--max-body-bytes)",
        code="body_too_large",
        headers={"Connection": "close"} if close else None,
    )
