"""`kv_transfer_params`: what a prefill engine hands the decode side (through the client or the
proxy), parsed into a typed, validated object at the boundary and, with a shared secret,
signed by the producer.

    {"req_id": str, "engine_id": str, "epoch": str, "host": str, "port": int,
     "block_tables": [[page, ...], ...], "num_tokens": int, "lease_s": float,
     "prompt_hash": str, "expires": float, "signature": str}

`prompt_hash` is the SHA-256 of the first `num_tokens` prompt tokens (int64 little-endian),
`expires` a Unix time (the end of the producer's first lease), `epoch` the producer process's
random identity (its NIXL agent is named `engine_id:epoch`, so a restarted producer is a new
peer). `signature` = HMAC-SHA256(secret, msgpack of every other field), hex.

A decode engine with a secret accepts only parameters whose signature verifies, that have not
expired and that it has not used before (`ReplayGuard`); every engine checks the prompt hash
against the request's own prompt, so transferred pages are never registered in the prefix
cache under tokens other than the ones the producer computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any

import msgpack

MAX_TABLE = 1 << 20  # pages per group: far above any real pool
MAX_GROUPS = 64


class Forbidden(ValueError):
    """Transfer parameters that are forged, expired, replayed, or name a peer not allowed
    (HTTP 403)."""


def same(a: str, b: str) -> bool:
    """Constant-time equality of two strings of any characters (`hmac.compare_digest` refuses
    non-ASCII str)."""
    return hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass")
    )


def prompt_hash(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of token ids as int64 little-endian."""
    digest = hashlib.sha256()
    for t in token_ids:
        digest.update(int(t).to_bytes(8, "little", signed=True))
    return digest.hexdigest()


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"kv_transfer_params: {name} must be an integer in [{low}, {high}]")
    return value


def _str(value: Any, name: str, limit: int = 256) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise ValueError(f"kv_transfer_params: {name} must be a non-empty string")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e12:
        raise ValueError(f"kv_transfer_params: {name} must be a positive number")
    return float(value)


@dataclasses.dataclass(frozen=True)
class TransferParams:
    """Validated transfer parameters (module docstring)."""

    req_id: str
    engine_id: str
    epoch: str
    host: str
    port: int
    block_tables: tuple[tuple[int, ...], ...]
    num_tokens: int
    lease_s: float
    prompt_hash: str
    expires: float
    signature: str = ""

    @property
    def peer(self) -> tuple[str, int]:
        """The producer's side-channel address."""
        return self.host, self.port

    @classmethod
    def parse(cls, raw: Any, num_prompt_tokens: int) -> TransferParams:
        """Check every field's type and range against a prompt of `num_prompt_tokens` tokens;
        ValueError naming the field otherwise."""
        if not isinstance(raw, dict):
            raise ValueError("kv_transfer_params must be an object")
        tables = raw.get("block_tables")
        if (
            not isinstance(tables, list | tuple)
            or not 0 < len(tables) <= MAX_GROUPS
            or not all(
                isinstance(t, list | tuple)
                and len(t) <= MAX_TABLE
                and all(type(p) is int and 0 <= p < 2**31 for p in t)
                for t in tables
            )
        ):
            raise ValueError("kv_transfer_params: block_tables must be a list of lists of page ids")
        n = raw.get("num_tokens")
        if type(n) is not int or not 0 < n < num_prompt_tokens:
            raise ValueError(
                f"kv_transfer_params: num_tokens must be an integer in [1, {num_prompt_tokens}) "
                f"for a prompt of {num_prompt_tokens} tokens, got {n!r}"
            )
        digest = raw.get("prompt_hash")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ValueError("kv_transfer_params: prompt_hash must be a SHA-256 hex digest")
        signature = raw.get("signature", "")
        if not isinstance(signature, str) or len(signature) > 128:
            raise ValueError("kv_transfer_params: signature must be a hex string")
        return cls(
            req_id=_str(raw.get("req_id"), "req_id", 1024),
            engine_id=_str(raw.get("engine_id"), "engine_id"),
            epoch=_str(raw.get("epoch"), "epoch", 64),
            host=_str(raw.get("host"), "host"),
            port=_int(raw.get("port"), "port", 1, 65535),
            block_tables=tuple(tuple(t) for t in tables),
            num_tokens=n,
            lease_s=_number(raw.get("lease_s"), "lease_s"),
            prompt_hash=digest,
            expires=_number(raw.get("expires"), "expires"),
            signature=signature,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`parse` inverts it)."""
        out = dataclasses.asdict(self)
        out["block_tables"] = [list(t) for t in self.block_tables]
        return out

    def _payload(self) -> bytes:
        fields = self.to_dict()
        fields.pop("signature")
        return msgpack.packb(sorted(fields.items()), use_bin_type=True)

    def signed(self, secret: bytes | None) -> TransferParams:
        """These parameters with their signature (unchanged without a secret)."""
        if secret is None:
            return self
        mac = hmac.new(secret, self._payload(), hashlib.sha256).hexdigest()
        return dataclasses.replace(self, signature=mac)

    def verify(self, secret: bytes | None, token_ids: Sequence[int], now: float | None = None):
        """Refuse (Forbidden) parameters whose signature does not verify or that expired, and
        parameters computed for other tokens than `token_ids[:num_tokens]`."""
        if secret is not None:
            want = hmac.new(secret, self._payload(), hashlib.sha256).hexdigest()
            if not same(want, self.signature):
                raise Forbidden("kv_transfer_params: the signature does not verify")
            if (time.time() if now is None else now) > self.expires:
                raise Forbidden("kv_transfer_params: expired (the prefill lease is over)")
        if not same(prompt_hash(token_ids[: self.num_tokens]), self.prompt_hash):
            raise Forbidden("kv_transfer_params: computed for a different prompt")


class ReplayGuard:
    """Signatures already used, until they expire: signed parameters start one transfer."""

    def __init__(self) -> None:
        self._used: dict[str, float] = {}

    def claim(self, params: TransferParams) -> None:
        """Record a use; Forbidden when these signed parameters were used before."""
        if not params.signature:
            return
        now = time.time()
        if len(self._used) > 4096:
            self._used = {s: t for s, t in self._used.items() if t >= now}
        if params.signature in self._used:
            raise Forbidden("kv_transfer_params: already used (replayed)")
        self._used[params.signature] = params.expires


def peer_allowed(host: str, port: int, allowed: tuple[str, ...], secret: bool) -> bool:
    """Whether a decode engine may contact the producer at host:port: listed in `allowed`
    (as "host" or "host:port"), or, with no list, any host with a secret and loopback ones
    without."""
    from hybridserve.config import is_loopback

    if allowed:
        return host in allowed or f"{host}:{port}" in allowed
    return secret or is_loopback(host)
