"""Processes, a stalled side channel, a watchdog and an HTTP client for the P/D chaos test.

FixedPortServer  `hybridserve serve --port PORT` that can be SIGKILLed and restarted on the
                 same port (the proxy's `--decode`/`--prefill` URLs are fixed); incarnation i
                 logs to NAME.i.log, and /v1/stats is snapshotted before each kill so that
                 counters can be summed over incarnations.
ProxyProcess     `hybridserve proxy --port 0`.
DripServer       a TCP server that accepts, then sends one byte every few seconds: a peer
                 whose NIXL side channel stalls mid-handshake.
Watchdog         a thread that records processes exiting on their own and /health answers
                 other than 200, except for the processes marked down (killed on purpose).
send / disconnect  one client request with a hard deadline, classified into an `Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from server_harness import ProxyProcess as SharedProxy
from server_harness import ServerProcess

# Outcomes that end a request clearly; anything else is a harness-visible failure.
CLEAR = {"ok", "error_4xx", "error_5xx", "sse_error", "aborted", "disconnected", "late"}
# ok: tokens and a finish reason; error_4xx/5xx: an OpenAI error body; sse_error: a stream
# that ended with an error event; aborted: finish_reason "abort" (a server-side timeout);
# disconnected: the client closed the connection before the answer was complete (injected);
# late: a disconnect request whose answer was complete before the client closed.
# Failures: timeout (no end within the client's deadline), truncated (a stream cut without
# [DONE] or an error event), conn_error (no answer at all), bad_error (an error status without
# the OpenAI error body), bad_ok (a 200 without choices or finish reason).


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _test_env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


class FixedPortServer(ServerProcess):
    """`python -m hybridserve.cli serve --port PORT ARGS`, restartable on the same port."""

    def __init__(self, args: list[str], log_dir: Path, name: str) -> None:
        super().__init__(args, log_dir, name)
        self.name = name
        self.log_dir = Path(log_dir)
        self.fixed_port = free_port()
        self.incarnation = 0
        self.log_paths: list[Path] = []
        self.snapshots: list[dict[str, Any]] = []  # /v1/stats of killed incarnations

    def launch(self) -> FixedPortServer:
        self.url = ""
        self.log_path = self.log_dir / f"{self.name}.{self.incarnation}.log"
        self.log_paths.append(self.log_path)
        command = [sys.executable, "-m", "hybridserve.cli", "serve"]
        command += ["--port", str(self.fixed_port), *self.args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=_test_env()
            )
        return self

    @property
    def fixed_url(self) -> str:
        """The URL of every incarnation (`url` is empty while one starts)."""
        return f"http://127.0.0.1:{self.fixed_port}"

    def sigkill(self) -> None:
        """Snapshot /v1/stats (best effort), then SIGKILL and reap the process."""
        try:
            self.snapshots.append(httpx.get(self.url + "/v1/stats", timeout=3).json())
        except (httpx.HTTPError, ValueError):
            self.snapshots.append({})
        self.kill()

    def restart(self, timeout: float = 180.0) -> FixedPortServer:
        self.incarnation += 1
        return self.launch().wait_ready(timeout)

    def all_logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.log_paths if p.exists())

    def total(self, key: str, final: dict[str, Any]) -> int | None:
        """`key` summed over the killed incarnations' snapshots and `final`; None if missing."""
        if key not in final:
            return None
        return sum(int(s.get(key, 0)) for s in self.snapshots) + int(final[key])


class ProxyProcess(SharedProxy):
    """The shared `hybridserve proxy --port 0` process, with the harness's log interface."""

    def all_logs(self) -> str:
        return self.log()


class DripServer:
    """Accepts connections and reads what they send, but answers one byte every `interval_s`
    (a frame header announcing 4 KiB, then its payload) for at most `duration_s` per
    connection: a side channel that stalls without ever going silent for long."""

    def __init__(self, interval_s: float = 2.0, duration_s: float = 20.0) -> None:
        self.interval_s, self.duration_s = interval_s, duration_s
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.accepted = 0
        self.active = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name="drip", daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self.active += 1
            thread = threading.Thread(target=self._drip, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _drip(self, conn: socket.socket) -> None:
        payload = struct.pack(">I", 4096) + b"\x81" * 4096
        sent, now = 0, time.monotonic()
        end, next_byte = now + self.duration_s, now
        try:
            with conn:
                while not self._stop.is_set() and time.monotonic() < end:
                    now = time.monotonic()
                    if now >= next_byte:
                        conn.sendall(payload[sent : sent + 1])
                        sent += 1
                        next_byte = now + self.interval_s
                    readable, _, _ = select.select([conn], [], [], max(0.0, next_byte - now))
                    if readable and not conn.recv(1 << 16):
                        return  # the peer gave up
        except OSError:
            return
        finally:
            with self._lock:
                self.active -= 1

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


class Watchdog:
    """Every `period_s`: each process must still run and answer /health with 200, unless it is
    marked down. Records what it saw as `events` (time since start, name, what)."""

    def __init__(self, procs: dict[str, ServerProcess], period_s: float = 1.0) -> None:
        self.procs = procs
        self.period_s = period_s
        self.down: set[str] = set()  # killed on purpose: neither checked
        self.quiet: set[str] = set()  # /health not checked (the proxy while a role is down)
        self.events: list[tuple[float, str, str]] = []
        self.health_checks = 0
        self._exited: set[tuple[str, int]] = set()  # (name, pid) already reported
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _note(self, name: str, what: str) -> None:
        self.events.append((round(time.monotonic() - self._t0, 1), name, what))

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.period_s):
                for name, proc in list(self.procs.items()):
                    self._check(client, name, proc)

    def _check(self, client: httpx.Client, name: str, proc: ServerProcess) -> None:
        if name in self.down or proc.proc is None:
            return
        if proc.proc.poll() is not None:
            key = (name, proc.proc.pid)
            if key not in self._exited:
                self._exited.add(key)
                self._note(name, f"exited on its own (rc {proc.proc.returncode})")
            return
        if name in self.quiet:
            return
        try:
            status = client.get(proc.url + "/health").status_code
            detail = f"/health {status}"
        except httpx.HTTPError as err:
            status, detail = 0, f"/health failed: {type(err).__name__}"
        self.health_checks += 1
        if status != 200 and name not in self.quiet:
            self._note(name, detail)

    def exits(self) -> list[tuple[float, str, str]]:
        return [e for e in self.events if "exited" in e[2]]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# -- client -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """How one request ended: `kind` (normal, bad_decode, disconnect, stalled, expired) and
    `stream` describe what was sent; `outcome` is one of CLEAR or a failure name."""

    index: int
    kind: str
    stream: bool
    outcome: str = "not_sent"
    status: int | None = None
    start: float = 0.0
    end: float = 0.0
    detail: str = ""

    @property
    def clear(self) -> bool:
        return self.outcome in CLEAR


def _error_body(content: bytes) -> bool:
    with contextlib.suppress(ValueError, AttributeError):
        error = json.loads(content).get("error")
        return isinstance(error, dict) and isinstance(error.get("message"), str)
    return False


def _judge_json(status: int, content: bytes) -> tuple[str, str]:
    if status != 200:
        kind = "error_4xx" if 400 <= status < 500 else "error_5xx"
        return (kind if _error_body(content) else "bad_error"), content[:200].decode(
            errors="replace"
        )
    try:
        choice = json.loads(content)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return "bad_ok", content[:200].decode(errors="replace")
    reason = choice.get("finish_reason")
    if reason in ("length", "stop"):
        return "ok", ""
    return ("aborted" if reason == "abort" else "bad_ok"), f"finish_reason {reason!r}"


def judge_events(lines: list[str]) -> tuple[str, str]:
    """A 200 stream's outcome from its `data:` lines (see CLEAR)."""
    done, reason, error = False, None, None
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        with contextlib.suppress(ValueError):
            event = json.loads(data)
            if isinstance(event, dict) and "error" in event:
                error = str(event["error"])[:200]
            for choice in event.get("choices") or []:
                reason = choice.get("finish_reason") or reason
    if error is not None:
        return "sse_error", error
    if not done:
        return "truncated", f"no [DONE] after {len(lines)} lines"
    if reason in ("length", "stop"):
        return "ok", ""
    return ("aborted" if reason == "abort" else "bad_ok"), f"finish_reason {reason!r}"


async def send(
    client: httpx.AsyncClient, url: str, body: dict, result: Outcome, timeout_s: float
) -> Outcome:
    """POST `body` to `url` (streamed if `result.stream`) and classify the end (`result`)."""
    result.start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            if not result.stream:
                reply = await client.post(url, json=body)
                result.status = reply.status_code
                result.outcome, result.detail = _judge_json(reply.status_code, reply.content)
            else:
                async with client.stream("POST", url, json=body) as reply:
                    result.status = reply.status_code
                    if reply.status_code != 200:
                        content = await reply.aread()
                        result.outcome, result.detail = _judge_json(reply.status_code, content)
                    else:
                        lines = []
                        try:
                            async for line in reply.aiter_lines():
                                lines.append(line)
                        except httpx.HTTPError as err:
                            lines.append(f"! {type(err).__name__}")
                        result.outcome, result.detail = judge_events(lines)
    except TimeoutError:
        result.outcome, result.detail = "timeout", f"no end within {timeout_s:g} s"
    except httpx.HTTPError as err:
        result.outcome, result.detail = "conn_error", f"{type(err).__name__}: {err}"[:200]
    result.end = time.monotonic()
    return result


async def disconnect(
    url: str, path: str, body: dict, result: Outcome, after_s: float, timeout_s: float
) -> Outcome:
    """Send `body` on a raw connection and close it `after_s` seconds later (streamed: after
    the first event). `late` when the answer was complete before the close (non-streamed: any
    answer; streamed: `[DONE]` or an error status); `timeout` when a stream sent no event
    within `timeout_s`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    result.start = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    got, hung = b"", False

    def started() -> bool:  # headers in, and an event (or an error status, or nothing more)
        head_end = got.find(b"\r\n\r\n")
        return head_end >= 0 and (b" 200 " not in got[:head_end] or b"data: " in got[head_end:])

    try:
        writer.write(head + data)
        await writer.drain()
        if result.stream:
            try:
                async with asyncio.timeout(timeout_s):
                    while not started() and (chunk := await reader.read(1 << 16)):
                        got += chunk
            except TimeoutError:
                hung = True
        if not hung:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(after_s):
                    while chunk := await reader.read(1 << 16):
                        got += chunk
            # What reached the socket before the close counts: on a loaded event loop bytes
            # can sit unread for a while after they arrived, and an answer the server had
            # finished writing is no disconnect the server could see. One read of what is
            # there, no waiting for more.
            with contextlib.suppress(TimeoutError):
                got += await asyncio.wait_for(reader.read(1 << 16), 0.005)
    except OSError as err:
        result.detail = f"{type(err).__name__}: {err}"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    result.end = time.monotonic()
    status_line = got.split(b"\r\n", 1)[0].decode(errors="replace")
    parts = status_line.split()
    result.status = int(parts[1]) if status_line.startswith("HTTP/") and len(parts) > 1 else None
    if hung:
        result.outcome, result.detail = "timeout", f"no event within {timeout_s:g} s"
        return result
    if result.stream and result.status == 200:
        complete = b"data: [DONE]" in got
    else:
        complete = result.status is not None
    result.outcome = "late" if complete else "disconnected"
    result.detail = result.detail or status_line
    return result
