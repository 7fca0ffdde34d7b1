"""The KV connector interface: how an engine hands a prompt's cache pages to another engine.

An engine that serves disaggregated prefill/decode owns one connector. The engine never talks
to the transport itself: `core.kv_transfer.KVTransfers` (the scheduler side) drives the
connector below, and the connector moves bytes between engines (NIXL in
`hybridserve.disagg.connector`; an in-process page copy in the tests). Plain Python, no jax.

The two halves, in the order a P/D request meets them:

Scheduler side (host bookkeeping, called on the engine thread):
  1. `parse_params(raw, token_ids)`: a decode engine's request arrived with another engine's
     `kv_transfer_params`; validate them at the boundary (ValueError, or a subclass of
     it for forged or replayed ones) into a typed `KVTransferParams`.
  2. `lookup_peer(params)`: the producer, once it is reachable (None: not yet; raises: never).
  3. `request_finished(req_id, block_tables, token_ids)`: a prefill engine finished a request
     whose pages it holds; start the hold and return the parameters the decode side needs.
  4. `released()`: held requests whose pages the prefill engine may free now (read, written,
     given up, lease over); `release(raw)`: free the hold named by parameters from outside.
  5. `give_up(params)`: the decode side will not read them (the producer frees at once);
     `keep_alive(waiting)`: heartbeats for requests still waiting for pages.

Worker side (the device memory):
  6. The connector is built over the engine's `CacheRegions` (arrays, addresses, page layout)
     and registers that memory once (`create_connector`).
  7. `start_load(req_id, params, slots, peer)`: fill the decode side's pages `slots`
     (`core.outputs.RemoteSlots`) from the producer's; raises when nothing could be posted.
  8. `finished_loads()`: `(req_id, ok, reason)` of transfers that ended; `loading(req_id)`
     says a transfer still writes a request's pages (they must not be reused yet).
  9. `close()`: release the transport (idempotent).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from hybridserve.config.errors import ConfigError
from hybridserve.config.kv_transfer import KV_CONNECTORS, KVTransferConfig


@dataclasses.dataclass(frozen=True)
class KVTransferParams:
    """What a request asks of P/D, parsed at the boundary.

    `do_remote_decode`: prefill side; compute the prompt but its last token, hold the pages and
    return the decode side's parameters. Otherwise a decode-side request: `num_tokens` tokens
    computed elsewhere, `remote` the connector's own validated parameters (opaque here)."""

    do_remote_decode: bool = False
    num_tokens: int = 0
    remote: Any = None


class KVConnector(abc.ABC):
    """One engine's end of the P/D transport (the module docstring gives the lifecycle).

    `config` holds the role (`is_producer`, `is_consumer`), `wait_timeout_s` and
    `failure_policy`; `engine_id` names this engine to its peers."""

    config: KVTransferConfig
    engine_id: str

    # -- scheduler side ---------------------------------------------------------------------

    @abc.abstractmethod
    def parse_params(self, raw: Any, token_ids: list[int]) -> KVTransferParams:
        """Validate a decode-side request's parameters (step 1)."""

    @abc.abstractmethod
    def lookup_peer(self, params: KVTransferParams) -> Any | None:
        """The producer of `params` once reachable; None while not yet; raises if never."""

    @abc.abstractmethod
    def request_finished(
        self, req_id: str, block_tables: Sequence[Sequence[int]], token_ids: list[int]
    ) -> dict[str, Any]:
        """Prefill side: hold a finished request's pages; its parameters for the decode side."""

    @abc.abstractmethod
    def released(self) -> list[str]:
        """Prefill side: the held requests whose pages may be freed now."""

    @abc.abstractmethod
    def release(self, raw: Any) -> str | None:
        """Prefill side: end the hold named by parameters this engine returned (its decode leg
        failed). The req_id released, or None (not ours, not held, wrongly signed)."""

    @abc.abstractmethod
    def give_up(self, params: KVTransferParams) -> None:
        """Decode side: the producer's pages will not be read (best effort)."""

    def keep_alive(self, waiting: list[KVTransferParams]) -> None:
        """Decode side: renew the producers' holds of requests that still wait (default:
        holds do not expire)."""
        return None

    def count_failure(self) -> None:
        """Decode side: a request that never got its transfer started (for the stats)."""
        return None

    # -- worker side ------------------------------------------------------------------------

    @abc.abstractmethod
    def start_load(self, req_id: str, params: KVTransferParams, slots: Any, peer: Any) -> None:
        """Fill the decode side's pages `slots` from the producer's (step 7)."""

    @abc.abstractmethod
    def finished_loads(self) -> list[tuple[str, bool, str | None]]:
        """`(req_id, ok, reason)` of every decode-side transfer that ended since the last call."""

    @abc.abstractmethod
    def loading(self, req_id: str) -> bool:
        """A transfer is writing `req_id`'s pages now."""

    @property
    @abc.abstractmethod
    def idle(self) -> bool:
        """Nothing in flight: no holds, transfers or handshakes."""

    def stats(self) -> dict[str, int]:
        """Counters for `LLMEngine.stats()` (bytes moved, failures, ...)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport and what it registered (idempotent)."""


def register_connector(name: str, target: str) -> None:
    """Make `KVTransferConfig(kv_connector=name)` build `target` ("module:Class", a subclass of
    `KVConnector` taking `(config, regions)`)."""
    if ":" not in target:
        raise ValueError(f"connector target must be 'module:Class', got {target!r}")
    KV_CONNECTORS[name] = target


def create_connector(config: KVTransferConfig, regions: Any) -> KVConnector:
    """The connector `config.kv_connector` names (`config.KV_CONNECTORS`: names resolve here,
    so that core imports no transport), built over the engine's cache regions."""
    module, _, name = KV_CONNECTORS[config.kv_connector].partition(":")
    connector = getattr(importlib.import_module(module), name)(config, regions)
    if not isinstance(connector, KVConnector):
        raise ConfigError(f"{module}:{name} is not a KVConnector")
    return connector
