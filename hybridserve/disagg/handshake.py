"""The side channel: a prefill worker serves its NIXL agent metadata and cache layout over TCP,
to peers that prove they hold the deployment's shared secret.

Wire format: frames of `[4-byte big-endian length][msgpack map]`, never pickle. A frame over
its limit, a non-map payload, a wrong `version`, a failed proof or an incompatible layout is
refused with an `{"error": ...}` reply naming the problem; the server then closes that
connection and keeps serving others.

Lifecycle of one handshake (each connection has its own thread and one overall deadline that
covers DNS, connect and every read, so a peer that drips bytes cannot hold it longer):
  1. server -> client `{"version", "nonce": s}` (16 random bytes; nothing else is sent before
     the client has proved the secret).
  2. client -> server `{"version", "nonce": c, "proof": HMAC(secret, "client" s c)}`; the server
     checks the proof (constant time) and answers `{"proof": HMAC(secret, "server" c s)}`, which
     the client checks in turn. Without a secret both proofs are empty (loopback deployments).
  3. client -> server its request (layout summary, agent metadata); the server runs
     `check(request)` (raising ValueError on a mismatch) and replies with `info` (engine id,
     epoch, agent name, agent metadata, layout dicts per rank).
`HandshakeServer(info, check, secret)` accepts in a daemon thread (at most `max_clients`
connections at once; more are closed at once) and survives accept() errors; `close()` stops it.
`fetch_peer(host, port, request, secret, timeout)` is the client side.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

log = logging.getLogger(__name__)

VERSION = 2
MAX_FRAME = 64 * 2**20  # agent metadata of a large deployment stays far below this
MAX_HELLO = 4096  # frames before the proof
_HEADER = struct.Struct(">I")


class HandshakeError(RuntimeError):
    """The peer refused us, or sent something we refuse."""


def _proof(secret: bytes | None, role: bytes, first: bytes, second: bytes) -> bytes:
    if secret is None:
        return b""
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError(f"handshake deadline passed after {got} of {n} bytes")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except TimeoutError as err:
            raise HandshakeError("handshake deadline passed") from err
        if not chunk:
            raise HandshakeError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise HandshakeError(f"message of {len(payload)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(
    sock: socket.socket, limit: int = MAX_FRAME, deadline: float | None = None
) -> dict[str, Any]:
    """One msgpack map, refusing oversized, malformed or non-map payloads and peers that do
    not finish it before `deadline` (time.monotonic(); None: 60 s from now)."""
    deadline = time.monotonic() + 60.0 if deadline is None else deadline
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if size > limit:
        raise HandshakeError(f"frame of {size} bytes exceeds the limit of {limit}")
    try:
        message = msgpack.unpackb(
            _recv_exact(sock, size, deadline),
            raw=False,
            strict_map_key=True,
            max_bin_len=limit,
            max_str_len=limit,
        )
    except (msgpack.UnpackException, ValueError, TypeError) as err:
        raise HandshakeError(f"malformed handshake frame: {err}") from err
    if not isinstance(message, dict):
        raise HandshakeError(f"handshake frame is a {type(message).__name__}, not a map")
    return message


def _check_version(message: dict[str, Any]) -> None:
    if message.get("version") != VERSION:
        raise HandshakeError(
            f"handshake version {message.get('version')!r}; this worker speaks {VERSION}"
        )


def _nonce(message: dict[str, Any]) -> bytes:
    nonce = message.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != 16:
        raise HandshakeError("the handshake nonce must be 16 bytes")
    return nonce


class HandshakeServer:
    """Serves `info` to authenticated peers whose request passes `check` (module docstring)."""

    def __init__(
        self,
        info: dict[str, Any],
        check: Callable[[dict[str, Any]], None],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 5.0,
        secret: bytes | None = None,
        max_clients: int = 16,
    ) -> None:
        self.info, self.check, self.timeout, self.secret = info, check, timeout, secret
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)  # here: a server closed at once must not fail its thread
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_clients)
        self.refused: list[str] = []  # the last reasons (bounded)
        self.num_refused = 0
        self.num_served = 0
        self._thread = threading.Thread(target=self._serve, name="handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as err:  # closed, or out of file descriptors: keep serving
                if self._stop.is_set() or self._sock.fileno() < 0:
                    return
                log.warning("handshake accept failed: %s", err)
                time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many handshakes at once: the peer retries later
                self._refuse("too many concurrent handshakes")
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _refuse(self, reason: str) -> None:
        self.num_refused += 1
        self.refused = [*self.refused[-31:], reason]

    def _answer(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            with conn:
                try:
                    mine = os.urandom(16)
                    send_frame(conn, {"version": VERSION, "nonce": mine})
                    hello = recv_frame(conn, MAX_HELLO, deadline)
                    _check_version(hello)
                    theirs = _nonce(hello)
                    proof = hello.get("proof")
                    want = _proof(self.secret, b"client", mine, theirs)
                    if not isinstance(proof, bytes) or not hmac.compare_digest(proof, want):
                        raise HandshakeError("authentication failed (the shared secret differs)")
                    send_frame(conn, {"proof": _proof(self.secret, b"server", theirs, mine)})
                    request = recv_frame(conn, MAX_FRAME, deadline)
                    self.check(request)
                    send_frame(conn, {"version": VERSION, **self.info})
                    self.num_served += 1
                except Exception as err:  # any frame a peer sends: refuse it, keep serving
                    self._refuse(str(err))
                    with contextlib.suppress(OSError, HandshakeError):
                        send_frame(conn, {"version": VERSION, "error": str(err)})
        finally:
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


def fetch_peer(
    host: str,
    port: int,
    request: dict[str, Any],
    timeout: float = 5.0,
    secret: bytes | None = None,
) -> dict[str, Any]:
    """Ask a prefill worker for its info within `timeout` seconds in all (DNS, connect, the
    proofs, the reply); raises HandshakeError with the reason (the peer's, when it refused)."""
    deadline = time.monotonic() + timeout
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            hello = recv_frame(sock, MAX_HELLO, deadline)
            if "error" in hello:
                raise HandshakeError(f"peer {where} refused the handshake: {hello['error']}")
            _check_version(hello)
            theirs, mine = _nonce(hello), os.urandom(16)
            proof = _proof(secret, b"client", theirs, mine)
            send_frame(sock, {"version": VERSION, "nonce": mine, "proof": proof})
            answer = recv_frame(sock, MAX_HELLO, deadline)
            if "error" in answer:
                raise HandshakeError(f"peer {where} refused the handshake: {answer['error']}")
            want = _proof(secret, b"server", mine, theirs)
            got = answer.get("proof")
            if not isinstance(got, bytes) or not hmac.compare_digest(got, want):
                raise HandshakeError(f"peer {where} failed to prove the shared secret")
            send_frame(sock, {"version": VERSION, **request})
            reply = recv_frame(sock, MAX_FRAME, deadline)
    except OSError as err:
        raise HandshakeError(f"cannot reach {where}: {err}") from err
    if "error" in reply:
        raise HandshakeError(f"peer {where} refused the handshake: {reply['error']}")
    _check_version(reply)
    return reply
