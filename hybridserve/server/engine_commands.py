"""What the event loop and the engine thread of an `AsyncEngine` pass each other: the commands
(event loop -> engine thread), the per-request output stream (engine thread -> event loop) and
the errors a request can end with."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams


class NotAccepting(RuntimeError):
    """The server is shutting down or its engine died (HTTP 503)."""


class QueueFull(RuntimeError):
    """`max_queue` requests are already waiting or running (HTTP 429)."""


class RequestTimeout(RuntimeError):
    """The request ran past its deadline and was aborted."""


class EngineDead(RuntimeError):
    """The engine loop failed; the request cannot finish."""


class EngineStopped(RuntimeError):
    """The engine was shut down before the request finished."""


@dataclasses.dataclass
class Add:
    req_id: str
    prompt: str | list[int]
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    deadline: float | None  # time.monotonic()
    outputs: asyncio.Queue
    verdict: asyncio.Future
    multi_modal_data: dict | None = None  # the engine thread runs the encoders


@dataclasses.dataclass
class Abort:
    req_id: str


@dataclasses.dataclass
class Release:
    params: dict[str, Any]
    verdict: asyncio.Future


class Stop:
    pass


class RequestStream:
    """The outputs of one request, as an async iterator; `close()` aborts it if unfinished."""

    def __init__(self, owner: Any, req_id: str, outputs: asyncio.Queue) -> None:
        self.req_id = req_id
        self._owner = owner
        self._outputs = outputs
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner._live.discard(self.req_id)

    def close(self) -> None:
        """Abort the request in the engine unless it finished (idempotent, non-blocking)."""
        if not self.finished:
            self._end()
            self._owner._commands.put(Abort(self.req_id))
