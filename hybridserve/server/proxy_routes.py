"""One proxied completion or chat completion: the prefill leg, the decode leg, and what is done
when either fails or the client leaves.

Lifecycle of a request (`handle`):
  1. the body is read and checked as the server does (`body.read_json`): 413, 408, and 400 for
     any body the upstreams could not take (NaN, 1e400, lone surrogates, deep nesting, 5000-digit
     integers) — before any upstream sees it;
  2. a decode instance must be in rotation, else 503 at once: no prefill runs for nothing;
  3. prefill leg: the body with `max_tokens` 1, `stream` false and `kv_transfer_params:
     {"do_remote_decode": true}` to a prefill instance (round-robin; one that refuses the
     connection leaves the rotation and the next is tried). A non-200 answer goes back to the
     client as it is; a 200 without `kv_transfer_params` is a 502;
  4. decode leg: the client's body plus those parameters to a decode instance. Not streamed:
     its answer goes back as it is. Streamed: its server-sent events are relayed, whole events
     only; an upstream that dies mid-stream ends the client's stream with an error event,
     `data: {"error": {...}}`, and `data: [DONE]` instead of a cut connection;
  5. until the answer (or the stream's head) is there, a watcher on `request.receive()` sees a
     client that leaves: the upstream request is cancelled, which closes its connection, which
     makes the upstream server abort the request. A streamed client that leaves later cancels
     the relay, which closes the decode stream likewise;
  6. when the decode leg did not finish — a non-200 answer, no decode instance answered, an
     upstream error, a cut stream, the client gone — the prefill instance is told at once to
     free the pages it holds: `POST {prefill}/v1/kv_transfer/release` with
     `{"kv_transfer_params": <the prefill's parameters>}`, in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from hybridserve.server import protocol as P
from hybridserve.server.body import encode_json, read_json
from hybridserve.server.errors import APIError
from hybridserve.server.proxy_state import Instance, NoInstance, ProxyState

log = logging.getLogger("hybridserve.proxy")

_JSON = {"Content-Type": "application/json"}
_PASSED_HEADERS = ("retry-after", "x-request-id")
_MAX_PENDING = 1 << 20  # bytes of one server-sent event the relay waits for before sending
_DONE = b"data: [DONE]\n\n"


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


@dataclasses.dataclass
class _Legs:
    """What one request has done so far: whose pages to release if the decode leg fails."""

    prefill: Instance | None = None
    params: dict[str, Any] | None = None
    finished: bool = False  # the decode leg finished (or its stream took over the release)

    def release_if_unfinished(self, state: ProxyState) -> None:
        if self.prefill is not None and self.params is not None and not self.finished:
            self.finished = True
            state.spawn(state.release(self.prefill, self.params))


async def handle(state: ProxyState, request: Request, path: str) -> Response:
    """Serve one request through a prefill and a decode instance (see the module docstring)."""
    stats = state.stats
    stats.requests += 1
    legs = _Legs()
    try:
        body = await read_json(request, state.max_body_bytes, state.body_timeout_s)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        prompt = body.get("prompt")
        if body.get("n", 1) != 1 or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
        ):
            raise APIError(
                400,
                "several choices (n > 1 or a batch of prompts) do not run disaggregated: send "
                "one request per choice",
                param="n" if body.get("n", 1) != 1 else "prompt",
            )
        state.require("decode")
        return await _watched(request, _two_legs(state, body, path, legs))
    except APIError as err:
        if err.status == 499:
            stats.client_disconnects += 1
        return err.response()
    except ClientLeft:
        stats.client_disconnects += 1
        return Response(status_code=499)
    except NoInstance as err:
        stats.no_instance += 1
        return APIError(503, str(err), "service_unavailable", code="no_instance").response()
    finally:
        legs.release_if_unfinished(state)


async def _watched(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """`work`'s result, or ClientLeft once the client disconnects (`work` is then cancelled,
    and waited for, so that its upstream connection is closed when this returns)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientLeft
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _two_legs(state: ProxyState, body: dict, path: str, legs: _Legs) -> Response:
    """Steps 3 and 4 of the module docstring."""
    first = {**body, "stream": False, "max_tokens": 1}
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    first["kv_transfer_params"] = {"do_remote_decode": True}
    try:
        reply, prefill = await _post(state, "prefill", path, encode_json(first))
    except NoInstance:
        state.stats.prefill_failures += 1
        raise
    except httpx.HTTPError as err:
        state.stats.prefill_failures += 1
        raise APIError(502, f"the prefill instance failed: {err!r}", "upstream_error") from err
    if reply.status_code != 200:
        state.stats.prefill_failures += reply.status_code >= 500
        return _passed_on(reply)
    params = _params_of(reply)
    if params is None:
        state.stats.prefill_failures += 1
        raise APIError(502, "the prefill instance returned no kv_transfer_params", "upstream_error")
    legs.prefill, legs.params = prefill, params
    second = encode_json({**body, "kv_transfer_params": params})
    try:
        if body.get("stream"):
            return await _open_stream(state, path, second, legs)
        reply, _ = await _post(state, "decode", path, second)
    except NoInstance:
        state.stats.decode_failures += 1
        raise
    except httpx.HTTPError as err:
        state.stats.decode_failures += 1
        raise APIError(502, f"the decode instance failed: {err!r}", "upstream_error") from err
    if reply.status_code == 200:
        legs.finished = True
    else:
        state.stats.decode_failures += reply.status_code >= 500
    return _passed_on(reply)


def _params_of(reply: httpx.Response) -> dict[str, Any] | None:
    try:
        params = reply.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None


def _passed_on(reply: httpx.Response, content: bytes | None = None) -> Response:
    """An upstream's answer, as it is (status, body, content type, Retry-After)."""
    headers = {k: reply.headers[k] for k in _PASSED_HEADERS if k in reply.headers}
    return Response(
        reply.content if content is None else content,
        reply.status_code,
        headers=headers,
        media_type=reply.headers.get("content-type", "application/json"),
    )


async def _post(
    state: ProxyState, role: str, path: str, content: bytes
) -> tuple[httpx.Response, Instance]:
    """POST to the first instance of `role` that accepts the connection."""
    last: Exception | None = None
    for inst in state.pick(role):
        try:
            reply = await _stack(
                state.client.post(f"{inst.url}{path}", content=content, headers=_JSON)
            )
            return reply, inst
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            _refused(state, inst, err)
            last = err
    raise NoInstance(f"no {role} instance answered: {last!r}")


async def _stack(call: Coroutine[Any, Any, httpx.Response]) -> httpx.Response:
    """An upstream call whose failures are all httpx errors: httpcore can fail with a plain
    error (AttributeError on a socket whose peer was just killed) that would otherwise end the
    client's connection without an answer."""
    try:
        return await call
    except (httpx.HTTPError, asyncio.CancelledError):
        raise
    except Exception as err:
        raise httpx.TransportError(f"{type(err).__name__}: {err}") from err


def _refused(state: ProxyState, inst: Instance, err: Exception) -> None:
    if isinstance(err, httpx.ConnectError):
        inst.down(f"connection refused: {err}")
    else:
        inst.failed(f"connect timeout: {err}", state.unhealthy_after)


async def _open_stream(state: ProxyState, path: str, content: bytes, legs: _Legs) -> Response:
    """Open the decode stream; its head decides: a non-200 is passed on, a 200 is relayed."""
    last: Exception | None = None
    for inst in state.pick("decode"):
        request = state.client.build_request(
            "POST", f"{inst.url}{path}", content=content, headers=_JSON
        )
        try:
            upstream = await _stack(state.client.send(request, stream=True))
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            _refused(state, inst, err)
            last = err
            continue
        if upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            state.stats.decode_failures += upstream.status_code >= 500
            return _passed_on(upstream, content)
        legs.finished = True  # from here on, the relay releases if the stream does not finish
        relay = _Relay(state, upstream, legs.prefill, legs.params)
        headers = {"Cache-Control": "no-cache"}
        if "x-request-id" in upstream.headers:
            headers["X-Request-Id"] = upstream.headers["x-request-id"]
        return StreamingResponse(
            relay.events(),
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(relay.close),
        )
    raise NoInstance(f"no decode instance answered: {last!r}")


class _Relay:
    """One decode stream relayed to the client: whole events; an error event and [DONE] if the
    upstream fails mid-stream; at the end (`close`, once) the upstream closed and, unless the
    stream finished, the prefill's pages released."""

    def __init__(
        self,
        state: ProxyState,
        upstream: httpx.Response,
        prefill: Instance | None,
        params: dict[str, Any] | None,
    ) -> None:
        self.state = state
        self.upstream = upstream
        self.prefill = prefill
        self.params = params
        self.finished = False  # the upstream sent its whole stream ([DONE])
        self.cut = False  # the upstream failed mid-stream
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        """The events for the client's StreamingResponse."""
        pending = b""
        try:
            async for chunk in self.upstream.aiter_bytes():
                pending += chunk
                end = pending.rfind(b"\n\n") + 2
                if end == 1 and len(pending) > _MAX_PENDING:
                    end = len(pending)
                if end > 1:
                    events, pending = pending[:end], pending[end:]
                    self.finished = self.finished or _DONE in events
                    yield events
            if pending:
                yield pending
            self.finished = True
        except Exception as err:  # httpx errors, and plain ones from a socket closed under it
            self.cut = True
            if not self.finished:
                self.state.stats.decode_failures += 1
                log.warning("the decode stream of %s failed: %r", self.upstream.url, err)
                message = f"the decode instance failed mid-stream: {err!r}"
                info = P.ErrorInfo(message=message, type="upstream_error", code="upstream_error")
                yield f"data: {P.ErrorResponse(error=info).model_dump_json()}\n\n".encode()
                yield _DONE
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the upstream (a client that left: the decode instance aborts) and release
        unless finished. Also the response's background task: it runs even when the client
        left before the first event, when `events` never started."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True), contextlib.suppress(httpx.HTTPError):
            await self.upstream.aclose()
        if not self.finished:
            if not self.cut:
                self.state.stats.client_disconnects += 1
            if self.prefill is not None and self.params is not None:
                self.state.spawn(self.state.release(self.prefill, self.params))
