"""`KVTransferConfig`: the settings of a disaggregated prefill/decode engine (vLLM's
`--kv-transfer-config` shape). Standard library only."""

from __future__ import annotations

import dataclasses
import ipaddress
import os

from hybridserve.config.errors import require

SECRET_ENV = "HYBRIDSERVE_KV_SECRET"


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# connector name -> "module:Class" of a `core.connector.KVConnector` (resolved at engine start;
# `core.connector.register_connector` adds one, e.g. a test double)
KV_CONNECTORS: dict[str, str] = {"NixlConnector": "hybridserve.disagg.connector:NixlConnector"}


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode over NIXL (vLLM's `--kv-transfer-config` shape).

    kv_role: "kv_producer" (prefill), "kv_consumer" (decode) or "kv_both". The producer serves
    its NIXL metadata and layout on a TCP side channel at host:port (port 0: any free port) and
    holds a request's pages for at most `lease_s` seconds after prefill. `failure_policy` says
    what a decode request does when its transfer fails: "recompute" locally or "fail".
    `transfer_mode` (decode side): "pull" (the decode engine READs) or "push" (it asks the
    prefill engine to WRITE). `nixl_threads`: worker threads of NIXL's UCX backend (0: none).
    `nixl_progress_delay_us`: the pause of the NIXL agent's progress thread between passes
    (None: 0 on GPUs, where it spins as vLLM's does; 10,000 on host memory, where a spinning
    thread takes a whole core of the machine per agent and an idle instance should sleep).
    `wait_timeout_s` (decode side): how long a request may wait for cache pages or a seat
    before its transfer starts; past it the request recomputes locally or fails (per
    `failure_policy`) and the prefill engine is told to free its pages.

    Security (`disagg.auth`): `secret` (or the environment variable HYBRIDSERVE_KV_SECRET) is
    the deployment's shared secret. With it, handshakes are mutually authenticated before any
    metadata or address is sent, and the prefill side signs the `kv_transfer_params` it
    returns; a decode engine accepts only signed, unexpired, unused parameters whose prompt
    hash matches. Without it, the side channel binds to loopback only and a decode engine only
    contacts loopback producers. `allowed_peers` (decode side): the producers it may contact,
    as "host" or "host:port" (empty: any, subject to the rule above).
    """

    kv_role: str = "kv_both"
    kv_connector: str = "NixlConnector"
    engine_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    wait_timeout_s: float = 600.0
    failure_policy: str = "recompute"
    transfer_mode: str = "pull"
    nixl_threads: int = 0
    nixl_progress_delay_us: int | None = None
    secret: str | None = dataclasses.field(default=None, repr=False)
    allowed_peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.allowed_peers, list):
            object.__setattr__(self, "allowed_peers", tuple(self.allowed_peers))
        require(
            isinstance(self.allowed_peers, tuple)
            and all(isinstance(p, str) and p for p in self.allowed_peers),
            f"allowed_peers must be a list of 'host' or 'host:port': {self.allowed_peers!r}",
        )
        require(
            self.secret is None or (isinstance(self.secret, str) and len(self.secret) >= 16),
            "secret must be a string of at least 16 characters",
        )
        require(
            self.secret_key is not None or is_loopback(self.host),
            f"the P/D side channel would bind to {self.host!r} without a shared secret: set "
            "`secret` (or HYBRIDSERVE_KV_SECRET) or bind to a loopback address",
        )
        require(self.kv_role in KV_ROLES, f"kv_role must be one of {KV_ROLES}: {self.kv_role!r}")
        require(
            self.kv_connector in KV_CONNECTORS,
            f"kv_connector {self.kv_connector!r} is not supported "
            f"(registered: {', '.join(sorted(KV_CONNECTORS))})",
        )
        require(
            self.failure_policy in ("recompute", "fail"),
            f"failure_policy must be 'recompute' or 'fail': {self.failure_policy!r}",
        )
        require(
            self.transfer_mode in ("pull", "push"),
            f"transfer_mode must be 'pull' or 'push': {self.transfer_mode!r}",
        )
        require(self.nixl_threads >= 0, f"nixl_threads must be >= 0: {self.nixl_threads}")
        require(
            self.nixl_progress_delay_us is None or self.nixl_progress_delay_us >= 0,
            f"nixl_progress_delay_us must be >= 0: {self.nixl_progress_delay_us}",
        )
        require(
            self.lease_s > 0 and self.transfer_timeout_s > 0 and self.wait_timeout_s > 0,
            "timeouts must be > 0",
        )

    @property
    def secret_key(self) -> bytes | None:
        """The shared secret (`secret`, else HYBRIDSERVE_KV_SECRET), or None."""
        secret = self.secret or os.environ.get(SECRET_ENV) or None
        return None if secret is None else secret.encode()

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
