"""The side channel: a prefill worker serves its NIXL agent metadata and cache layout over TCP.

Wire format: one frame each way, `[4-byte big-endian length][msgpack map]`, never pickle. A frame
over `MAX_FRAME` bytes, a non-map payload, a wrong `version` or an incompatible layout is
refused with an `{"error": ...}` reply naming the problem; the server then closes that
connection and keeps serving others.

Lifecycle:
  1. The prefill worker starts `HandshakeServer(info, check)`; it listens on a free port (or
     the given one) in a daemon thread.
  2. A decode worker calls `fetch_peer(host, port, request)`: it sends its own layout summary
     (`request`), the server runs `check(request)` (raising ValueError on a mismatch) and replies
     with `info` (agent name, agent metadata bytes, layout dicts per rank).
  3. `HandshakeServer.close()` stops the thread and closes the socket.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

VERSION = 1
MAX_FRAME = 64 * 2**20  # agent metadata of a large deployment stays far below this
_HEADER = struct.Struct(">I")


class HandshakeError(RuntimeError):
    """The peer refused us, or sent something we refuse."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
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


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> dict[str, Any]:
    """One msgpack map, refusing oversized, malformed or non-map payloads."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise HandshakeError(f"frame of {size} bytes exceeds the limit of {limit}")
    try:
        message = msgpack.unpackb(
            _recv_exact(sock, size),
            raw=False,
            strict_map_key=True,
            max_bin_len=limit,
            max_str_len=limit,
        )
    except (msgpack.UnpackException, ValueError) as err:
        raise HandshakeError(f"malformed handshake frame: {err}") from err
    if not isinstance(message, dict):
        raise HandshakeError(f"handshake frame is a {type(message).__name__}, not a map")
    return message


class HandshakeServer:
    """Serves `info` to peers whose request passes `check` (see the module docstring)."""

    def __init__(
        self,
        info: dict[str, Any],
        check: Callable[[dict[str, Any]], None],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 5.0,
    ) -> None:
        self.info, self.check, self.timeout = info, check, timeout
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)  # here: a server closed at once must not fail its thread
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self.refused: list[str] = []
        self._thread = threading.Thread(target=self._serve, name="handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(self.timeout)
                try:
                    request = recv_frame(conn)
                    if request.get("version") != VERSION:
                        raise ValueError(
                            f"handshake version {request.get('version')!r}; this "
                            f"worker speaks {VERSION}"
                        )
                    self.check(request)
                    send_frame(conn, {"version": VERSION, **self.info})
                except (HandshakeError, ValueError, KeyError, TypeError, OSError) as err:
                    self.refused.append(str(err))
                    with contextlib.suppress(OSError, HandshakeError):
                        send_frame(conn, {"version": VERSION, "error": str(err)})

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


def fetch_peer(
    host: str, port: int, request: dict[str, Any], timeout: float = 5.0
) -> dict[str, Any]:
    """Ask a prefill worker for its info; raises HandshakeError with the peer's reason."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        send_frame(sock, {"version": VERSION, **request})
        reply = recv_frame(sock)
    if "error" in reply:
        raise HandshakeError(f"peer {host}:{port} refused the handshake: {reply['error']}")
    if reply.get("version") != VERSION:
        raise HandshakeError(f"peer {host}:{port} speaks version {reply.get('version')!r}")
    return reply
