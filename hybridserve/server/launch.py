"""`hybridserve serve`: load the engine, bind the socket, run uvicorn until a signal.

Shutdown on SIGTERM or SIGINT: new requests get 503 and /health turns 503 at once; uvicorn
closes the listening socket and waits up to `drain_timeout_s` for the requests in flight to
finish (cancelling those still running after that, which aborts them in the engine); the
application's lifespan then stops the engine thread.

Heavy imports (JAX, the engine, FastAPI) happen inside `serve`, so that `parse_kv_transfer_config`
can reject a bad flag before any of them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from typing import Any

from hybridserve.config import KVTransferConfig

log = logging.getLogger("hybridserve.server")


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """`--kv-transfer-config` JSON -> KVTransferConfig; ValueError naming unknown keys or bad
    values."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--kv-transfer-config is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    known = [f.name for f in dataclasses.fields(KVTransferConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"--kv-transfer-config: unknown keys {unknown}; the known keys are {known}"
        )
    try:
        return KVTransferConfig(**data)
    except TypeError as err:  # a value of the wrong type met a comparison
        raise ValueError(f"--kv-transfer-config: a value has the wrong type: {err}") from err


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


def serve(
    engine_config: Any,
    settings: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queue: int = 256,
    log_level: str = "info",
) -> int:
    """Serve `engine_config` (an `EngineConfig`) with `settings` (a `ServerSettings`) until
    SIGTERM/SIGINT. Logs `listening on http://HOST:PORT` once the socket is bound."""
    import asyncio

    import uvicorn

    from hybridserve.engine import LLMEngine
    from hybridserve.server.app import build_app
    from hybridserve.server.async_engine import AsyncEngine

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = LLMEngine(engine_config, progress=False)
    async_engine = AsyncEngine(engine, max_queue=max_queue)
    app = build_app(async_engine, settings)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
        lifespan="on",
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            async_engine.stop_accepting()
            super().handle_exit(sig, frame)

    log.info(
        "serving %s (max_model_len %d) as %s; listening on http://%s:%d",
        engine_config.model,
        engine.max_model_len,
        list(settings.model_names),
        bound_host,
        bound_port,
    )
    asyncio.run(Server(config).serve(sockets=[sock]))
    return 0
