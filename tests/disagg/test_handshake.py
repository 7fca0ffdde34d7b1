"""The side channel refuses bad peers without crashing and serves good ones."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from hybridserve.disagg.handshake import HandshakeError, HandshakeServer, fetch_peer

INFO = {
    "agent_name": "prefill-0",
    "agent_metadata": bytes(range(256)) * 4,
    "layouts": [{"tp_rank": 0, "bases": [1 << 40, 2 << 40]}],
}


def _check(request):
    if request.get("kv_dtype") != "bfloat16":
        raise ValueError(f"kv_dtype mismatch: prefill bfloat16, decode {request.get('kv_dtype')}")


def _frame(obj) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


@pytest.fixture
def server():
    s = HandshakeServer(INFO, _check)
    yield s
    s.close()


def _raw(server, payload: bytes) -> dict:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(payload)
        head = sock.recv(4)
        (n,) = struct.unpack(">I", head)
        body = b""
        while len(body) < n:
            body += sock.recv(n - len(body))
    return msgpack.unpackb(body)


def test_good_peer_gets_the_info(server):
    reply = fetch_peer(server.host, server.port, {"kv_dtype": "bfloat16"})
    assert reply["agent_metadata"] == INFO["agent_metadata"]
    assert reply["layouts"] == INFO["layouts"]


def test_incompatible_peer_is_refused_with_the_mismatch(server):
    with pytest.raises(HandshakeError, match="kv_dtype mismatch: prefill bfloat16, decode fp8"):
        fetch_peer(server.host, server.port, {"kv_dtype": "fp8"})


@pytest.mark.parametrize(
    "payload,reason",
    [
        (struct.pack(">I", 1 << 30), "exceeds the limit"),  # oversized
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "malformed"),  # not msgpack
        (_frame([1]), "not a map"),
        (_frame({"version": 99}), "version 99"),
    ],
)
def test_bad_frames_are_refused_and_the_server_lives_on(server, payload, reason):
    reply = _raw(server, payload)
    assert reason in reply["error"]
    assert any(reason in r for r in server.refused)
    assert (
        fetch_peer(server.host, server.port, {"kv_dtype": "bfloat16"})["agent_name"] == "prefill-0"
    )
