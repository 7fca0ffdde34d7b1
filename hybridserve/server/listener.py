"""The HTTP listener of the server and the proxy: the bound socket, uvicorn's settings and an h11
protocol with read deadlines.

uvicorn's h11 protocol alone keeps a connection open for ever while its request head trickles
in (its keep-alive timer runs only between requests, and any byte stops it), and it reads the
rest of a body that the application answered early (413, 401, 404) for as long as it comes.
`GuardedH11Protocol` adds one deadline per connection, armed by state:
  1. head: a connection opened, or a request head begun, must complete its request head (request
     line and headers) within `header_timeout_s`; else the connection is closed (slowloris);
  2. none while the application runs: a body it reads has its own deadline (`body.read_body`
     answers 408 after `body_timeout_s`);
  3. body: once the response is sent while the request body is still arriving, the rest of the
     body must arrive within `body_timeout_s`. Until then it is read and dropped, so a client
     still sending (a chunked body over the size limit) reads its 413 instead of a connection
     reset; after it the connection is closed;
  4. none between requests: an idle keep-alive connection closes after `keep_alive_s`
     (uvicorn's `timeout_keep_alive`).
Request heads are limited to `max_head_bytes` (h11; more is a 400).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hybridserve.server")


@dataclasses.dataclass(frozen=True)
class HTTPLimits:
    """Per-connection read deadlines and sizes (see the module docstring)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_head_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body deadlines of the module docstring; made
    for one `HTTPLimits` by `protocol_for`."""

    limits: HTTPLimits = HTTPLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._kind: str | None = None
        super().connection_made(transport)
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm or drop the deadline for the connection's new state."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.conn.trailing_data[0]:
                self._arm("head")  # a request head has begun
            elif self._kind != "head":  # between requests: uvicorn's keep-alive timer
                self._disarm()
        elif state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete:
            self._arm("body")
        else:
            self._disarm()

    def _arm(self, kind: str) -> None:
        if self._kind == kind:
            return  # the deadline runs from the first moment, not the latest byte
        self._disarm()
        delay = self.limits.header_timeout_s if kind == "head" else self.limits.body_timeout_s
        self._timer = self.loop.call_later(delay, self._expire, kind)
        self._kind = kind

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._kind = None, None

    def _expire(self, kind: str) -> None:
        self._timer, self._kind = None, None
        if not self.transport.is_closing():
            log.info("closing a connection whose request %s was not complete in time", kind)
            self.transport.close()


def protocol_for(limits: HTTPLimits) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class with these limits (uvicorn instantiates it per connection)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class QuietProbes(logging.Filter):
    """Access-log lines of health checks and metrics scrapes (`PROBE_PATHS`) only at debug
    level: a load balancer's probe every few seconds would bury the requests."""

    PROBE_PATHS = ("/health", "/metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            path = str(args[2]).split("?", 1)[0]
            if path in self.PROBE_PATHS:
                return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def uvicorn_config(
    app: Any, limits: HTTPLimits, log_level: str, graceful_s: float, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn settings shared by the server and the proxy (`graceful_s`: how long uvicorn's
    own shutdown waits for open connections); probes are logged at debug level only."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietProbes) for f in access.filters):
        access.addFilter(QuietProbes())
    return uvicorn.Config(
        app,
        http=protocol_for(limits),
        log_level=log_level,
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=max(1, round(graceful_s)),
        h11_max_incomplete_event_size=limits.max_head_bytes,
        lifespan="on",
        **kwargs,
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
