"""The side channel: mutual proofs of the shared secret before anything else, bad peers refused
without crashing the server, and slow peers bounded by one deadline per connection."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import pytest

from hybridserve.disagg.handshake import VERSION, HandshakeError, HandshakeServer, fetch_peer

INFO = {
    "agent_name": "prefill-0",
    "agent_metadata": bytes(range(256)) * 4,
    "layouts": [{"tp_rank": 0, "bases": [1 << 40, 2 << 40]}],
}
SECRET = b"a shared secret of the deployment"


def _check(request):
    if request.get("kv_dtype") != "bfloat16":
        raise ValueError(f"kv_dtype mismatch: prefill bfloat16, decode {request.get('kv_dtype')}")


def _frame(obj) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


def _read(sock) -> dict:
    (n,) = struct.unpack(">I", sock.recv(4))
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return msgpack.unpackb(body)


@pytest.fixture(params=[None, SECRET], ids=["no-secret", "secret"])
def server(request):
    s = HandshakeServer(INFO, _check, timeout=1.0, secret=request.param)
    yield s
    s.close()


def _raw(server, payload: bytes) -> tuple[dict, dict]:
    """Send `payload` after the server's hello; (hello, the server's answer)."""
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        hello = _read(sock)
        sock.sendall(payload)
        return hello, _read(sock)


def test_good_peer_gets_the_info(server):
    reply = fetch_peer(server.host, server.port, {"kv_dtype": "bfloat16"}, secret=server.secret)
    assert reply["agent_metadata"] == INFO["agent_metadata"]
    assert reply["layouts"] == INFO["layouts"]


def test_incompatible_peer_is_refused_with_the_mismatch(server):
    with pytest.raises(HandshakeError, match="kv_dtype mismatch: prefill bfloat16, decode fp8"):
        fetch_peer(server.host, server.port, {"kv_dtype": "fp8"}, secret=server.secret)


@pytest.mark.parametrize(
    "payload,reason",
    [
        (struct.pack(">I", 1 << 30), "exceeds the limit"),  # oversized
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "malformed"),  # not msgpack
        (_frame([1]), "not a map"),
        (_frame({"version": 99}), "version 99"),
        (_frame({"version": VERSION, "nonce": b"short"}), "nonce"),
    ],
)
def test_bad_frames_are_refused_and_the_server_lives_on(server, payload, reason):
    hello, reply = _raw(server, payload)
    assert set(hello) == {"version", "nonce"}  # nothing about the engine before the proofs
    assert reason in reply["error"]
    assert any(reason in r for r in server.refused)
    good = fetch_peer(server.host, server.port, {"kv_dtype": "bfloat16"}, secret=server.secret)
    assert good["agent_name"] == "prefill-0"


def test_without_the_secret_a_peer_gets_no_metadata():
    server = HandshakeServer(INFO, _check, timeout=1.0, secret=SECRET)
    try:
        for secret in (None, b"another secret of the same length!"):
            with pytest.raises(HandshakeError, match="authentication failed"):
                fetch_peer(server.host, server.port, {"kv_dtype": "bfloat16"}, secret=secret)
        # a raw client that skips the proof and sends its request at once gets an error only
        request = {"version": VERSION, "nonce": b"0" * 16, "kv_dtype": "bfloat16"}
        hello, reply = _raw(server, _frame(request))
        assert set(reply) == {"version", "error"}
        assert server.num_served == 0
    finally:
        server.close()


def test_a_client_does_not_trust_a_server_without_the_secret():
    rogue = HandshakeServer(INFO, _check, timeout=1.0, secret=None)
    try:
        with pytest.raises(HandshakeError, match="authentication failed|failed to prove"):
            fetch_peer(rogue.host, rogue.port, {"kv_dtype": "bfloat16"}, secret=SECRET)
        assert rogue.num_served == 0  # our metadata never went out
    finally:
        rogue.close()


def test_drip_clients_do_not_block_others_and_end_at_the_deadline(server):
    """Twelve peers that send one byte every 0.3 s: each is cut at the 1 s deadline, and a
    good peer is served meanwhile."""
    socks = []
    stop = threading.Event()

    def drip(sock):
        with sock:
            payload = _frame({"version": VERSION, "nonce": b"0" * 16, "proof": b""})
            for byte in payload:
                if stop.is_set():
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.3)

    threads = []
    for _ in range(12):
        sock = socket.create_connection((server.host, server.port), timeout=5)
        socks.append(sock)
        threads.append(threading.Thread(target=drip, args=(sock,), daemon=True))
        threads[-1].start()
    try:
        start = time.monotonic()
        good = fetch_peer(server.host, server.port, {"kv_dtype": "bfloat16"}, secret=server.secret)
        assert good["agent_name"] == "prefill-0"
        assert time.monotonic() - start < 1.0
        time.sleep(1.5)
        assert sum("deadline" in r for r in server.refused) == 12
    finally:
        stop.set()


def test_fetch_peer_has_one_overall_deadline():
    """A server that answers one byte at a time cannot hold the client past its timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def slow():
        conn, _ = listener.accept()
        with conn:
            for byte in _frame({"version": VERSION, "nonce": b"0" * 16}):
                time.sleep(0.2)
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    threading.Thread(target=slow, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(HandshakeError, match="deadline"):
        fetch_peer("127.0.0.1", port, {}, timeout=0.8)
    assert time.monotonic() - start < 1.5
    listener.close()
