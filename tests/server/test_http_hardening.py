"""Hostile and failing clients at the HTTP layer, on the real server (the shared `server`
process) and on the proxy (uvicorn in a thread): slow request heads are cut off, bodies that
never finish get 408, a 10 MB chunked body gets 413 and not a reset, a lone surrogate is a 400
that keeps the connection, a client that leaves mid-body is a 499 and not a 500."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from app_harness import Upstreams, serve_in_thread
from server_harness import HEADER_TIMEOUT_S, counter, wait_until

from hybridserve.server.listener import HTTPLimits
from hybridserve.server.proxy import ProxyState, build_proxy

MB = 1 << 20
FAST = HTTPLimits(header_timeout_s=0.5, body_timeout_s=0.5)
COMPLETIONS = "/v1/completions"
REQUESTS = "hybridserve:http_requests_total"


@pytest.fixture(scope="module")
def proxy_url():
    """A proxy over scripted upstreams, with 0.5 s head and body deadlines."""
    up = Upstreams()
    state = ProxyState(
        ["http://p1:1"],
        ["http://d1:1"],
        body_timeout_s=FAST.body_timeout_s,
        transport=up.transport(),
    )
    with serve_in_thread(build_proxy(state), FAST) as url:
        yield url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and Content-Length body) read from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the peer closes `sock`, sending `trickle` a byte every 0.1 s meanwhile."""
    start = time.monotonic()
    sock.settimeout(0.1)
    for i in range(600):
        if i < len(trickle):
            try:
                sock.sendall(trickle[i : i + 1])
            except OSError:
                break
        try:
            if sock.recv(65536) == b"":
                break
        except TimeoutError:
            continue
        except OSError:
            break
    return time.monotonic() - start


def _chunked_10_mb() -> bytes:
    """A request with a 10 MB chunked body (no Content-Length), as one byte string."""
    chunk = b"%x\r\n%s\r\n" % (MB, b"a" * MB)
    body = b'c\r\n{"prompt": "\r\n' + chunk * 10 + b'2\r\n"}\r\n0\r\n\r\n'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    return head + b"Content-Type: application/json\r\n\r\n" + body


@pytest.mark.parametrize("target", ["server", "proxy"])
def test_a_request_head_that_never_ends_is_cut_off(target, request):
    url, limit = (
        (request.getfixturevalue("server").url, HEADER_TIMEOUT_S)
        if target == "server"
        else (request.getfixturevalue("proxy_url"), FAST.header_timeout_s)
    )
    with _connect(url) as idle:  # opens and sends nothing
        assert limit * 0.8 < _closed_after(idle) < limit + 5
    with _connect(url) as slow:  # sends its head a byte at a time: the bytes do not extend it
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        assert limit * 0.8 < _closed_after(slow, head) < limit + 5


def test_a_body_that_never_ends_gets_408_on_the_proxy(proxy_url):
    with _connect(proxy_url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        start = time.monotonic()
        answer = _response(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"body_timeout" in answer and time.monotonic() - start < 5


@pytest.mark.parametrize("target", ["server", "proxy"])
def test_a_10_mb_chunked_body_gets_413_not_a_reset(target, request):
    """The client sends its whole body first, then reads: the answer must still be there."""
    url = request.getfixturevalue("server").url if target == "server" else None
    url = url or request.getfixturevalue("proxy_url")
    with _connect(url) as sock:
        sock.sendall(_chunked_10_mb())  # a reset would raise here
        answer = _response(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"body_too_large" in answer
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_a_lone_surrogate_is_400_and_keeps_the_connection(server):
    body = b'{"prompt": "\\ud800"}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with _connect(server.url) as sock:
        sock.sendall(head + body)
        first = _response(sock)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection
        second = _response(sock)
    assert first.startswith(b"HTTP/1.1 400") and b"Unicode" in first, first
    assert b"connection: close" not in first.lower()
    assert second.startswith(b"HTTP/1.1 200"), second


def test_a_client_that_leaves_mid_body_is_499_not_500(server):
    before = server.metrics()
    with _connect(server.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)

    def counted() -> bool:
        return counter(server.metrics(), REQUESTS, endpoint=COMPLETIONS, status="499") > counter(
            before, REQUESTS, endpoint=COMPLETIONS, status="499"
        )

    assert wait_until(counted, 10)
    after = server.metrics()
    assert counter(after, REQUESTS, endpoint=COMPLETIONS, status="500") == counter(
        before, REQUESTS, endpoint=COMPLETIONS, status="500"
    )
