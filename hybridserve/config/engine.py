"""`EngineConfig`: every engine setting in one frozen tree, built from the flat vLLM-style keywords
users pass (`LLM(...)`, the CLI and server flags, worker specs) by `EngineConfig.from_kwargs`.
Standard library only.

    EngineConfig
      model, dtype, backend, seed, load_format, max_model_len   (model-level)
      scheduler: SchedulerConfig     continuous batching and prefix caching
      cache: CacheConfig             the paged cache
      parallel: ParallelConfig       device parallelism
      speculative: SpeculativeConfig | None
      kv_transfer: KVTransferConfig | None   (`hybridserve.config.kv_transfer`)

`KEYS` maps each flat keyword onto its place in the tree.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hybridserve.config.errors import ConfigError, require
from hybridserve.config.kv_transfer import KVTransferConfig


class SettingError(ConfigError, TypeError):
    """An unknown setting, or a value of the wrong type: a `ValueError` (as every `ConfigError`)
    and a `TypeError` (as an unexpected keyword argument or a bad operand is)."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device parallelism. Tensor parallelism shards heads, MLP and expert widths."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")


# the compute dtypes (None: the checkpoint's)
MODEL_DTYPES = (None, "float32", "bfloat16", "float16")
# KV cache dtypes: "auto", array dtype names, and vLLM's spellings of the 8-bit floats
KV_DTYPES = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "float8_e4m3fn",
    "float8_e5m2",
)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged cache. `kv_dtype`/`conv_dtype` "auto" follow the model dtype (the KV cache of a
    checkpoint with FP8 KV scales is e4m3: "fp8"; name a dtype to override); the ssm state is
    float32 unless set. `num_pages` fixes the pool size; otherwise `memory_bytes` per rank
    (`--kv-cache-memory`) is split into pages; without it, on a device that reports its memory
    (a GPU), the pool takes `gpu_memory_utilization` of the allocator's limit less the weights
    and the largest step program's activations (`runner.memory`), and elsewhere 256 MiB. The
    pool never exceeds what `2 * max_num_seqs` requests of max_model_len tokens can use.
    `block_size` is a lower bound (raised to fit a Mamba state)."""

    kv_dtype: str = "auto"
    conv_dtype: str = "auto"
    ssm_dtype: str = "float32"
    conv_layout: str | None = None  # DS | SD; None: $HYBRIDSERVE_SSM_CONV_LAYOUT or DS
    kernel_block_size: int = 16
    block_size: int | None = None
    num_pages: int | None = None
    memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        require(
            self.kv_dtype in KV_DTYPES,
            f"kv_dtype (kv_cache_dtype) {self.kv_dtype!r} is not one of {list(KV_DTYPES)}",
        )
        require(self.kernel_block_size > 0, "kernel_block_size must be > 0")
        require(self.num_pages is None or self.num_pages >= 2, "num_pages must be >= 2")
        require(
            self.memory_bytes is None or self.memory_bytes > 0,
            f"memory_bytes (kv_cache_memory) must be > 0, got {self.memory_bytes}",
        )
        require(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching. Each step computes at most `max_num_batched_tokens` tokens over at
    most `max_num_seqs` requests; one request's prefill chunk is at most `max_prefill_chunk`,
    and all prompt chunks of a step that also decodes together at most `max_num_prefill_tokens`
    (None: the budget; a step without decodes takes the whole budget). `decode_first`: every
    running decode gets its token before any prompt chunk, the prompts take what is left
    (vLLM's chunked prefill), so prefill never stalls decoding; False takes the running
    requests in arrival order, a prompt chunk possibly first.
    Prefix caching shares computed prefixes at a granularity of `prefix_unit` tokens (None: the
    largest divisor of the attention block that is a kernel-block multiple <= 256).
    `max_held_fraction`: the most of the pool that finished P/D prefill requests may hold for
    their decode side; past it new prefill-for-decode requests wait (held pages return when
    read, released or at the end of their lease). `async_scheduling`: schedule and dispatch
    step N+1 while step N runs, its sampled tokens fed to N+1 on the device (stop rules apply
    one step late; the extra token is dropped); speculative decoding and P/D engines step
    one at a time."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 256
    max_num_prefill_tokens: int | None = None
    decode_first: bool = True
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    prefix_unit: int | None = None
    max_held_fraction: float = 0.75
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        require(0 < self.max_held_fraction <= 1, "max_held_fraction must be in (0, 1]")
        require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens must be >= max_num_seqs",
        )
        require(self.max_prefill_chunk >= 1, "max_prefill_chunk must be >= 1")
        require(
            self.max_num_prefill_tokens is None or self.max_num_prefill_tokens >= 1,
            f"max_num_prefill_tokens must be >= 1 (or None), got {self.max_num_prefill_tokens}",
        )
        require(
            self.prefix_unit is None or self.prefix_unit >= 1,
            f"prefix_unit must be >= 1 (or None: automatic), got {self.prefix_unit}",
        )
        require(self.max_model_len >= 2, "max_model_len must be >= 2")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step verifies up to `num_speculative_tokens` draft
    tokens in one forward pass (`runner.speculative.verify`; exact for every sampling setting).
    `method`: "mtp" drafts with the model's MTP heads; "ngram" looks the request's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens up earlier in its prompt and output and
    proposes what followed them (vLLM's prompt lookup; no draft model, any architecture);
    "oracle" asks `oracle(token_ids, k)` for the next k tokens (perfect drafts for tests and
    benchmarks: e.g. a recorded greedy run)."""

    num_speculative_tokens: int = 1
    method: str = "mtp"
    oracle: Any = dataclasses.field(default=None, compare=False, repr=False)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        methods = ("mtp", "ngram", "oracle")
        require(self.method in methods, f"unknown speculative method {self.method!r}: {methods}")
        require(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1")
        require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max",
        )
        require(
            self.method != "oracle" or callable(self.oracle),
            "the oracle method needs a callable oracle(token_ids, k) -> draft token ids",
        )


def from_mapping(cls: type, data: Any, what: str) -> Any:
    """`cls(**data)` for a dict `data` (an instance of `cls` as is); `SettingError` for unknown
    keys (naming them) or a value of the wrong type. `what` names the setting in messages."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a {cls.__name__} or a dict of its fields")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SettingError(f"{what}: unknown keys {unknown}; the known keys are {known}")
    try:
        return cls(**data)
    except TypeError as err:  # a value of the wrong type met a comparison
        raise SettingError(f"{what}: a value has the wrong type: {err}") from err


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` is built from (the tree in the module docstring).

    `model`: the model directory. `dtype`: "float32", "bfloat16" or "float16" (None or "auto"
    keeps the checkpoint's).
    `backend`: the op backend ("auto": pallas kernels with XLA norms on GPUs, xla elsewhere;
    "xla", "pallas", "torch"; "BASE,OP=OTHER" takes one op from another backend). `seed`: base
    seed of requests whose SamplingParams carry none, and of dummy weights. `load_format`:
    "auto" reads the checkpoint, "dummy" draws random weights.
    `max_model_len`: longest prompt + output in tokens; the scheduler's `max_model_len` follows
    it (the engine lowers both to the model's `max_position_embeddings`). `enforce_eager`:
    skip the start-up compile of every step program (they compile on first use; vLLM's flag
    of the same name skips CUDA graph capture). Build one with `from_kwargs`.
    """

    model: str
    dtype: str | None = None
    backend: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    max_model_len: int = 2048
    enforce_eager: bool = False
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # vLLM's spelling of "the checkpoint's"
            object.__setattr__(self, "dtype", None)
        require(
            self.dtype in MODEL_DTYPES,
            f"dtype {self.dtype!r} is not one of {[d for d in MODEL_DTYPES if d]} or 'auto'",
        )
        if self.scheduler.max_model_len != self.max_model_len:
            scheduler = dataclasses.replace(self.scheduler, max_model_len=self.max_model_len)
            object.__setattr__(self, "scheduler", scheduler)

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike[str], **kwargs: Any) -> EngineConfig:
        """The config of `model` from the flat keywords of `KEYS` (`LLM`'s keyword arguments).

        Sub-configs come whole as `cache`, `scheduler`, `parallel`, `speculative_config` (alias
        `speculative`) and `kv_transfer_config` (alias `kv_transfer`), each an instance, a dict
        of its fields or None (the defaults; no speculative decoding; no P/D role); flat keys
        such as `block_size` or `prefix_unit` then override fields of theirs. An unknown key
        raises `SettingError` naming it; a bad value the sub-config's `ConfigError`.
        """
        unknown = sorted(set(kwargs) - set(KEYS) - set(WHOLE))
        if unknown:
            raise SettingError(
                f"unknown engine settings {unknown}; the known ones are {sorted([*KEYS, *WHOLE])}"
            )
        subs: dict[str, Any] = {}
        for key, (field, sub_cls) in WHOLE.items():
            if key not in kwargs:
                continue
            if field in subs:
                both = [k for k, (f, _) in WHOLE.items() if f == field and k in kwargs]
                raise ConfigError(f"{' and '.join(both)} are one setting: give one of them")
            value = kwargs[key]
            if value is None:
                subs[field] = None if field in OPTIONAL else sub_cls()
            else:
                subs[field] = from_mapping(sub_cls, value, key)
        top: dict[str, Any] = {}
        flat: dict[str, dict[str, Any]] = {}
        for key, (field, name) in KEYS.items():
            if key in kwargs:
                if field is None:
                    top[name] = kwargs[key]
                else:
                    flat.setdefault(field, {})[name] = kwargs[key]
        for field, values in flat.items():
            sub_cls = next(c for f, c in WHOLE.values() if f == field)
            base = subs.get(field) or sub_cls()
            subs[field] = dataclasses.replace(base, **values)
        if "max_model_len" not in top and "scheduler" in subs:
            top["max_model_len"] = subs["scheduler"].max_model_len
        return cls(model=str(model), **top, **subs)

    def flat(self) -> dict[str, Any]:
        """This config's value of every flat key of `KEYS`."""
        return {
            key: getattr(self if field is None else getattr(self, field), name)
            for key, (field, name) in KEYS.items()
        }

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The default value of every flat key of `KEYS`."""
        return cls(model="").flat()


# flat keyword -> (EngineConfig field holding it, or None for EngineConfig itself; field name)
KEYS: dict[str, tuple[str | None, str]] = {
    "dtype": (None, "dtype"),
    "backend": (None, "backend"),
    "seed": (None, "seed"),
    "load_format": (None, "load_format"),
    "max_model_len": (None, "max_model_len"),
    "enforce_eager": (None, "enforce_eager"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_prefill_chunk": ("scheduler", "max_prefill_chunk"),
    "max_num_prefill_tokens": ("scheduler", "max_num_prefill_tokens"),
    "decode_first": ("scheduler", "decode_first"),
    "enable_prefix_caching": ("scheduler", "enable_prefix_caching"),
    "prefix_unit": ("scheduler", "prefix_unit"),
    "max_held_fraction": ("scheduler", "max_held_fraction"),
    "async_scheduling": ("scheduler", "async_scheduling"),
    "block_size": ("cache", "block_size"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "kv_cache_memory": ("cache", "memory_bytes"),
    "kv_cache_dtype": ("cache", "kv_dtype"),
}
# keyword of a whole sub-config -> (EngineConfig field, its class)
WHOLE: dict[str, tuple[str, type]] = {
    "scheduler": ("scheduler", SchedulerConfig),
    "cache": ("cache", CacheConfig),
    "parallel": ("parallel", ParallelConfig),
    "speculative_config": ("speculative", SpeculativeConfig),
    "speculative": ("speculative", SpeculativeConfig),
    "kv_transfer_config": ("kv_transfer", KVTransferConfig),
    "kv_transfer": ("kv_transfer", KVTransferConfig),
}
OPTIONAL = ("speculative", "kv_transfer")  # None: off
