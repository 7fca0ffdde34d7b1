"""Frozen configuration dataclasses. Standard library only.

`ModelConfig` describes a hybrid decoder as a layer pattern plus the dimensions of each kind of
layer. `ModelConfig.from_hf(path)` reads a Hugging Face `config.json` (families `nemotron_h`,
`bamba`, `granitemoehybrid`); `to_dict` / `from_dict` give our own JSON form.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from pathlib import Path
from typing import Any

from hybridserve.layer_configs import (  # noqa: F401 (re-exported)
    ACTIVATIONS,
    LAYER_KINDS,
    ROUTERS,
    AttentionConfig,
    AudioConfig,
    ConfigError,
    MambaConfig,
    MlpConfig,
    MoeConfig,
    MtpConfig,
    SconvConfig,
    VisionConfig,
    _require,
)

SECRET_ENV = "HYBRIDSERVE_KV_SECRET"


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A hybrid decoder: `layer_types[i]` is the mixer of block i, one of LAYER_KINDS.

    Each block is `x += r * mixer(norm(x))`, followed, when `ffn` is set ("mlp" or "moe"), by
    `x += r * ffn(norm2(x))`, with r the residual multiplier. Logits are
    `lm_head(norm_f(x)) / logits_scaling`; embeddings are scaled by `embedding_multiplier`.
    With `sconv` (the Inkling blocks, attention mixers only), short convolutions act on the
    keys, values, attention output and ffn output (`SconvConfig`). `vision` / `audio` add the
    multimodal encoders whose embeddings replace placeholder tokens; `mtp` the chained draft
    heads of speculative decoding.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float
    ffn: str | None = None
    attention: AttentionConfig | None = None
    mamba: MambaConfig | None = None
    mlp: MlpConfig | None = None
    moe: MoeConfig | None = None
    sconv: SconvConfig | None = None
    vision: VisionConfig | None = None
    audio: AudioConfig | None = None
    mtp: MtpConfig | None = None
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        bad = sorted({k for k in self.layer_types if k not in LAYER_KINDS})
        _require(not bad, f"unknown layer kinds {bad}; expected some of {list(LAYER_KINDS)}")
        _require(len(self.layer_types) > 0, "the layer pattern is empty")
        _require(self.ffn in (None, "mlp", "moe"), f"ffn must be None, 'mlp' or 'moe': {self.ffn}")
        needs = set(self.layer_types) | ({self.ffn} if self.ffn else set())
        if "sliding_attention" in needs:
            needs.add("attention")
        for kind in ("attention", "mamba", "mlp", "moe"):
            if kind in needs:
                _require(
                    getattr(self, kind) is not None,
                    f"the layer pattern uses {kind!r} layers but the {kind} config is missing",
                )
        _require(self.vocab_size > 0 and self.hidden_size > 0, "vocab_size/hidden_size must be > 0")
        if self.attention is not None:
            sliding = "sliding_attention" in self.layer_types
            window = self.attention.sliding_window
            _require(
                sliding == (window is not None),
                "sliding_attention layers need attention.sliding_window, and a sliding_window "
                "needs sliding_attention layers (attention layers are full)",
            )
            _require(window is None or window > 0, f"sliding_window must be > 0, got {window}")

        if self.sconv is not None:
            _require(
                set(self.layer_types) <= {"attention", "sliding_attention"},
                "sconv blocks need attention mixers only (sconvs act on keys and values)",
            )
        for enc in (self.vision, self.audio):
            if enc is not None:
                _require(
                    0 <= enc.placeholder_id < self.vocab_size,
                    f"placeholder_id {enc.placeholder_id} is not a token id",
                )
        if self.mtp is not None:
            _require(self.attention is not None, "mtp heads need the attention config")
        if self.vision is not None:
            _require(
                self.vision.widths[-1] == self.hidden_size,
                "the last vision width must be the hidden size",
            )

    def window(self, index: int) -> int | None:
        """The attention window of layer `index` (None: full attention or not attention)."""
        if self.layer_types[index] == "sliding_attention":
            return self.attention.sliding_window
        return None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def pattern(self) -> str:
        """The layer pattern in Nemotron-H letters: M mamba, * attention, - mlp, E moe; and S
        sliding-window attention."""
        letters = {"mamba": "M", "attention": "*", "sliding_attention": "S", "mlp": "-", "moe": "E"}
        return "".join(letters[k] for k in self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (infinities as strings)."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`."""
        subs = {
            "attention": AttentionConfig,
            "mamba": MambaConfig,
            "mlp": MlpConfig,
            "moe": MoeConfig,
            "sconv": SconvConfig,
            "vision": VisionConfig,
            "audio": AudioConfig,
            "mtp": MtpConfig,
        }
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        _require(not unknown, f"unknown ModelConfig fields {unknown}")
        kwargs = dict(data)
        for key, sub in subs.items():
            if kwargs.get(key) is not None:
                kwargs[key] = sub(**_unjson(kwargs[key]))
        kwargs["layer_types"] = tuple(kwargs["layer_types"])
        kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids", ()))
        return cls(**kwargs)

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Parse a Hugging Face config (a `config.json` file or a directory holding one)."""
        from hybridserve.hf_config import parse_hf_config

        return parse_hf_config(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _unjson(data: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if v in ("inf", "-inf") else v) for k, v in data.items()}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device parallelism. Tensor parallelism shards heads, MLP and expert widths."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged cache. `kv_dtype`/`conv_dtype` "auto" follow the model dtype; the ssm state is
    float32 unless set. `num_pages` fixes the pool size; otherwise `memory_bytes` per rank is
    split into pages. `block_size` is a lower bound (raised to fit a Mamba state)."""

    kv_dtype: str = "auto"
    conv_dtype: str = "auto"
    ssm_dtype: str = "float32"
    conv_layout: str | None = None  # DS | SD; None: $HYBRIDSERVE_SSM_CONV_LAYOUT or DS
    kernel_block_size: int = 16
    block_size: int | None = None
    num_pages: int | None = None
    memory_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        _require(self.kernel_block_size > 0, "kernel_block_size must be > 0")
        _require(self.num_pages is None or self.num_pages >= 2, "num_pages must be >= 2")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching. Each step computes at most `max_num_batched_tokens` tokens over at
    most `max_num_seqs` requests; one request's prefill chunk is at most `max_prefill_chunk`.
    Prefix caching shares computed prefixes at a granularity of `prefix_unit` tokens (None: the
    largest divisor of the attention block that is a kernel-block multiple <= 256).
    `max_held_fraction`: the most of the pool that finished P/D prefill requests may hold for
    their decode side; past it new prefill-for-decode requests wait (held pages return when
    read, released or at the end of their lease)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 256
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    prefix_unit: int | None = None
    max_held_fraction: float = 0.75

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(0 < self.max_held_fraction <= 1, "max_held_fraction must be in (0, 1]")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens must be >= max_num_seqs",
        )
        _require(self.max_prefill_chunk >= 1, "max_prefill_chunk must be >= 1")
        _require(self.max_model_len >= 2, "max_model_len must be >= 2")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step verifies up to `num_speculative_tokens` draft
    tokens in one forward pass (`runner.speculative.verify`; exact for every sampling setting).
    `method`: "mtp" drafts with the model's MTP heads; "oracle" asks `oracle(token_ids, k)` for
    the next k tokens (perfect drafts for tests and benchmarks: e.g. a recorded greedy run)."""

    num_speculative_tokens: int = 1
    method: str = "mtp"
    oracle: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _require(self.method in ("mtp", "oracle"), f"unknown speculative method {self.method!r}")
        _require(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1")
        _require(
            self.method != "oracle" or callable(self.oracle),
            "the oracle method needs a callable oracle(token_ids, k) -> draft token ids",
        )


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
        _require(
            isinstance(self.allowed_peers, tuple)
            and all(isinstance(p, str) and p for p in self.allowed_peers),
            f"allowed_peers must be a list of 'host' or 'host:port': {self.allowed_peers!r}",
        )
        _require(
            self.secret is None or (isinstance(self.secret, str) and len(self.secret) >= 16),
            "secret must be a string of at least 16 characters",
        )
        _require(
            self.secret_key is not None or is_loopback(self.host),
            f"the P/D side channel would bind to {self.host!r} without a shared secret: set "
            "`secret` (or HYBRIDSERVE_KV_SECRET) or bind to a loopback address",
        )
        _require(self.kv_role in KV_ROLES, f"kv_role must be one of {KV_ROLES}: {self.kv_role!r}")
        _require(
            self.kv_connector in KV_CONNECTORS,
            f"kv_connector {self.kv_connector!r} is not supported "
            f"(registered: {', '.join(sorted(KV_CONNECTORS))})",
        )
        _require(
            self.failure_policy in ("recompute", "fail"),
            f"failure_policy must be 'recompute' or 'fail': {self.failure_policy!r}",
        )
        _require(
            self.transfer_mode in ("pull", "push"),
            f"transfer_mode must be 'pull' or 'push': {self.transfer_mode!r}",
        )
        _require(self.nixl_threads >= 0, f"nixl_threads must be >= 0: {self.nixl_threads}")
        _require(
            self.nixl_progress_delay_us is None or self.nixl_progress_delay_us >= 0,
            f"nixl_progress_delay_us must be >= 0: {self.nixl_progress_delay_us}",
        )
        _require(
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
