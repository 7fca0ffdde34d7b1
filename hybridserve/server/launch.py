"""`hybridserve serve`: load the engine, bind the socket, run uvicorn until a signal.

Shutdown (`DrainingServer`):
  1. the first SIGTERM or SIGINT stops admissions: new generation requests get 503 with
     Retry-After and /health answers 503, but the listener stays open (a load balancer sees
     503s, not refused connections);
  2. once no request is live in the engine, or after `drain_timeout_s`, uvicorn shuts down: it
     closes the listener, lets the open responses end (cancelling, which aborts them in the
     engine, those that do not end within 1 s of a drain that timed out) and the application's
     lifespan stops the engine thread;
  3. a second signal skips what is left of the drain.
Connections get the head and body deadlines of `listener.py`.

Heavy imports (JAX, the engine, FastAPI) happen inside `serve`, so that `parse_kv_transfer_config`
can reject a bad flag before any of them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import uvicorn

from hybridserve.config import KVTransferConfig, SpeculativeConfig
from hybridserve.config.engine import from_mapping
from hybridserve.server.listener import HTTPLimits, bind, uvicorn_config

__all__ = ["DrainingServer", "bind", "parse_kv_transfer_config", "serve"]

log = logging.getLogger("hybridserve.server")


def _json_config(text: str | None, cls: type, flag: str) -> Any:
    """A flag's JSON object -> `cls`; ValueError naming unknown keys or bad values."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return from_mapping(cls, data, flag)


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """`--kv-transfer-config` JSON -> KVTransferConfig; ValueError naming unknown keys or bad
    values."""
    return _json_config(text, KVTransferConfig, "--kv-transfer-config")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """`--speculative-config` JSON -> SpeculativeConfig ("mtp" or "ngram": the "oracle" method
    takes a Python function, which a flag cannot give)."""
    return _json_config(text, SpeculativeConfig, "--speculative-config")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining with the listener open on the first signal (see the module
    docstring). `engine` needs `stop_accepting()` and `num_live` (an `AsyncEngine`)."""

    def __init__(self, config: uvicorn.Config, engine: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Signal handler: the first signal starts the drain, a second one ends it."""
        if self.drain_deadline is None:
            self.engine.stop_accepting()
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: end the drain once the engine is idle or the drain timed out."""
        if self.drain_deadline is not None and not self.should_exit:
            if not self._drain_logged:
                self._drain_logged = True
                live = self.engine.num_live
                log.info("draining: %d requests in flight; new ones get 503", live)
            if time.monotonic() >= self.drain_deadline:
                log.warning("drain timed out with %d requests live", self.engine.num_live)
                self.config.timeout_graceful_shutdown = 1
                self.should_exit = True
            elif self.engine.num_live == 0:
                self.should_exit = True
        return await super().on_tick(counter)


def serve(
    engine_config: Any,
    settings: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queue: int = 256,
    log_level: str = "info",
    chat_template: Any = None,
) -> int:
    """Serve `engine_config` (an `EngineConfig`) with `settings` (a `ServerSettings`) until
    SIGTERM/SIGINT (`chat_template`: a `ChatTemplate` instead of the model's). Logs
    `listening on http://HOST:PORT` once the socket is bound."""
    import asyncio

    from hybridserve.engine import LLMEngine, wants_warmup
    from hybridserve.server.app import build_app
    from hybridserve.server.async_engine import AsyncEngine

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # jax logs its probe of every platform it was built for (TPU: "Unable to initialize
    # backend 'tpu'", with libtpu installed) at INFO: not news on a CPU or GPU server
    if log_level.lower() not in ("debug", "trace"):
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    engine = LLMEngine(engine_config, progress=False, warmup=False)
    if wants_warmup(engine_config):  # before the socket is bound: healthy means compiled
        start = time.perf_counter()
        count = engine.warmup(progress=True)
        done = engine.stats()
        log.info(
            "warmed up %d step programs in %.1f s (%d XLA programs compiled, %d loaded from the "
            "compilation cache %s)",
            count,
            time.perf_counter() - start,
            done["programs_compiled"],
            done["programs_loaded"],
            engine.compilation_cache or "(off)",
        )
    async_engine = AsyncEngine(engine, max_queue=max_queue)
    app = build_app(async_engine, settings, chat_template)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    limits = HTTPLimits(
        header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s
    )
    config = uvicorn_config(app, limits, log_level, graceful_s=settings.drain_timeout_s)
    log.info(
        "serving %s (max_model_len %d) as %s%s; listening on http://%s:%d",
        engine_config.model,
        engine.max_model_len,
        list(settings.model_names),
        " with an API key" if settings.api_key else "",
        bound_host,
        bound_port,
    )
    runner = engine.runner
    log.info(
        "cache pool: %d pages, %.2f GiB per device%s; it holds %d requests of max_model_len "
        "%d tokens (%d tokens)",
        runner.num_pages - 1,
        runner.cache_bytes / runner.plan.tensor_parallel_size / 2**30,
        ""
        if runner.pool_sizing is None
        else f" (sized by memory: {runner.pool_sizing.budget_bytes / 2**30:.2f} GiB beyond the "
        f"weights, {runner.pool_sizing.activation_bytes / 2**30:.2f} GiB of activations)",
        engine.full_requests,
        engine.max_model_len,
        engine.full_requests * engine.max_model_len,
    )
    asyncio.run(DrainingServer(config, async_engine, settings.drain_timeout_s).serve([sock]))
    return 0
