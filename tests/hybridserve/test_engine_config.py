"""EngineConfig.from_kwargs: every flat key lands in its sub-config, unknown keys are refused
naming them, the defaults are those of the engine before the config was one, bad values keep
their messages; the CLI's flag table maps onto the same keys. No JAX."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hybridserve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
    SettingError,
    SpeculativeConfig,
)
from hybridserve.config.engine import KEYS, WHOLE
from hybridserve.server.flags import (
    ENGINE_FLAGS,
    SERVE_ENGINE_FLAGS,
    add_engine_args,
    engine_kwargs,
)
from hybridserve.server.launch import parse_kv_transfer_config

# The defaults of `LLM(...)`, the old flat `EngineConfig` and the CLI before the one config
# (the backend since became "auto": the fastest measured on the device, xla on the CPU).
OLD_DEFAULTS = {
    "dtype": None,
    "tensor_parallel_size": 1,
    "backend": "auto",
    "max_model_len": 2048,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "max_prefill_chunk": 256,
    "enable_prefix_caching": True,
    "seed": 0,
    "load_format": "auto",
    "block_size": None,
    "prefix_unit": None,
    "max_held_fraction": 0.75,
    "async_scheduling": True,  # since: overlapped steps
    "max_num_prefill_tokens": None,  # since: decode first, prompts capped per step
    "decode_first": True,
    "gpu_memory_utilization": 0.9,  # since: pools sized by memory (the CPU: 256 MiB, as before)
    "kv_cache_memory": None,
    "kv_cache_dtype": "auto",
    "enforce_eager": False,
}

# flat key -> (a non-default value, where it lands)
SAMPLES = {
    "dtype": ("bfloat16", lambda c: c.dtype),
    "backend": ("pallas", lambda c: c.backend),
    "seed": (7, lambda c: c.seed),
    "load_format": ("dummy", lambda c: c.load_format),
    "max_model_len": (4096, lambda c: (c.max_model_len, c.scheduler.max_model_len)),
    "tensor_parallel_size": (2, lambda c: c.parallel.tensor_parallel_size),
    "max_num_seqs": (4, lambda c: c.scheduler.max_num_seqs),
    "max_num_batched_tokens": (1024, lambda c: c.scheduler.max_num_batched_tokens),
    "max_prefill_chunk": (64, lambda c: c.scheduler.max_prefill_chunk),
    "enable_prefix_caching": (False, lambda c: c.scheduler.enable_prefix_caching),
    "prefix_unit": (32, lambda c: c.scheduler.prefix_unit),
    "max_held_fraction": (0.5, lambda c: c.scheduler.max_held_fraction),
    "async_scheduling": (False, lambda c: c.scheduler.async_scheduling),
    "block_size": (64, lambda c: c.cache.block_size),
    "max_num_prefill_tokens": (128, lambda c: c.scheduler.max_num_prefill_tokens),
    "decode_first": (False, lambda c: c.scheduler.decode_first),
    "gpu_memory_utilization": (0.5, lambda c: c.cache.gpu_memory_utilization),
    "kv_cache_memory": (2**30, lambda c: c.cache.memory_bytes),
    "kv_cache_dtype": ("fp8", lambda c: c.cache.kv_dtype),
    "enforce_eager": (True, lambda c: c.enforce_eager),
}
SPEC = SpeculativeConfig(num_speculative_tokens=3)
KV = KVTransferConfig(kv_role="kv_producer")
WHOLE_SAMPLES = {
    "scheduler": (SchedulerConfig(max_num_seqs=2), lambda c: c.scheduler.max_num_seqs, 2),
    "cache": ({"num_pages": 40}, lambda c: c.cache, CacheConfig(num_pages=40)),
    "parallel": ({"tensor_parallel_size": 4}, lambda c: c.parallel, ParallelConfig(4)),
    "speculative_config": ({"num_speculative_tokens": 3}, lambda c: c.speculative, SPEC),
    "speculative": (SPEC, lambda c: c.speculative, SPEC),
    "kv_transfer_config": ({"kv_role": "kv_producer"}, lambda c: c.kv_transfer, KV),
    "kv_transfer": (KV, lambda c: c.kv_transfer, KV),
}


def test_defaults_are_the_old_ones():
    assert EngineConfig.defaults() == OLD_DEFAULTS
    config = EngineConfig.from_kwargs("m")
    assert config == EngineConfig(model="m")
    assert config.cache == CacheConfig() and config.scheduler == SchedulerConfig()
    assert config.speculative is None and config.kv_transfer is None
    none = EngineConfig.from_kwargs(
        "m", cache=None, speculative_config=None, kv_transfer_config=None
    )
    assert none == config


def test_every_flat_key_lands_in_its_place():
    assert set(SAMPLES) == set(KEYS)
    assert set(WHOLE_SAMPLES) == set(WHOLE)
    for key, (value, where) in SAMPLES.items():
        config = EngineConfig.from_kwargs("m", **{key: value})
        assert where(config) == ((value, value) if key == "max_model_len" else value), key
        others = {k: v for k, v in config.flat().items() if k != key}
        assert others == {k: v for k, v in OLD_DEFAULTS.items() if k != key}, key
    for key, (value, where, expected) in WHOLE_SAMPLES.items():
        assert where(EngineConfig.from_kwargs("m", **{key: value})) == expected, key


def test_flat_keys_override_their_sub_config():
    config = EngineConfig.from_kwargs(
        "m", cache=CacheConfig(num_pages=40), block_size=64, max_num_seqs=4, prefix_unit=16
    )
    assert config.cache == CacheConfig(num_pages=40, block_size=64)
    assert config.scheduler.max_num_seqs == 4 and config.scheduler.prefix_unit == 16
    whole = EngineConfig.from_kwargs("m", scheduler=SchedulerConfig(max_model_len=512))
    assert whole.max_model_len == whole.scheduler.max_model_len == 512
    assert dataclasses.replace(whole, max_model_len=300).scheduler.max_model_len == 300


def test_unknown_keys_are_named():
    for error in (TypeError, ValueError):
        with pytest.raises(error, match=r"unknown engine settings \['max_num_seq'\]"):
            EngineConfig.from_kwargs("m", max_num_seq=4)
    with pytest.raises(SettingError, match=r"speculative_config: unknown keys \['tokens'\]"):
        EngineConfig.from_kwargs("m", speculative_config={"tokens": 3})
    with pytest.raises(SettingError, match=r"cache: unknown keys \['pages'\]"):
        EngineConfig.from_kwargs("m", cache={"pages": 3})
    with pytest.raises(ConfigError, match="kv_transfer_config and kv_transfer are one setting"):
        EngineConfig.from_kwargs("m", kv_transfer=KV, kv_transfer_config=KV)
    with pytest.raises(ConfigError, match="must be a CacheConfig or a dict"):
        EngineConfig.from_kwargs("m", cache=40)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        (
            {"max_num_seqs": 16, "max_num_batched_tokens": 8},
            "max_num_batched_tokens must be >= max_num_seqs",
        ),
        ({"max_prefill_chunk": 0}, "max_prefill_chunk must be >= 1"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"max_held_fraction": 0}, r"max_held_fraction must be in \(0, 1\]"),
        ({"prefix_unit": 0}, "prefix_unit must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"cache": {"num_pages": 1}}, "num_pages must be >= 2"),
        ({"speculative_config": {"method": "eagle"}}, "unknown speculative method 'eagle'"),
        ({"speculative_config": {"num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"kv_transfer_config": {"kv_role": "kv_peer"}}, "kv_role must be one of"),
        ({"kv_transfer_config": {"transfer_mode": "pipe"}}, "transfer_mode must be"),
    ],
)
def test_bad_values_keep_their_messages(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs("m", **kwargs)


def test_cli_flags_map_onto_the_keys():
    flags = ENGINE_FLAGS + SERVE_ENGINE_FLAGS
    assert {f.key for f in flags} <= set(KEYS)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_engine_args(parser, SERVE_ENGINE_FLAGS)
    given = parser.parse_args([])
    assert engine_kwargs(given) == {} and engine_kwargs(given, SERVE_ENGINE_FLAGS) == {}
    argv = "--dtype bfloat16 --backend pallas -tp 2 --max-model-len 512 --max-num-seqs 4"
    argv += " --max-num-batched-tokens 64 --max-prefill-chunk 32 --no-prefix-caching"
    argv += " --prefix-unit 16 --block-size 64 --seed 3"
    args = parser.parse_args(argv.split())
    assert {**engine_kwargs(args), **engine_kwargs(args, SERVE_ENGINE_FLAGS)} == {
        "dtype": "bfloat16",
        "backend": "pallas",
        "tensor_parallel_size": 2,
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "max_prefill_chunk": 32,
        "enable_prefix_caching": False,
        "prefix_unit": 16,
        "block_size": 64,
        "seed": 3,
    }
    assert "(default: 2048)" in parser.format_help().replace("\n", " ").replace("  ", " ")


def test_kv_transfer_flag_keeps_its_messages():
    with pytest.raises(ValueError, match=r"--kv-transfer-config: unknown keys \['kv_rank'\]"):
        parse_kv_transfer_config('{"kv_rank": 1}')
    with pytest.raises(ValueError, match="--kv-transfer-config: a value has the wrong type"):
        parse_kv_transfer_config('{"nixl_threads": "2"}')
    assert parse_kv_transfer_config('{"kv_role": "kv_consumer"}').is_consumer


def test_dtype_auto_is_the_checkpoints_and_a_bad_one_is_named():
    assert EngineConfig.from_kwargs("m", dtype="auto").dtype is None
    assert EngineConfig.from_kwargs("m", dtype="float16").dtype == "float16"
    with pytest.raises(ConfigError, match="dtype 'int8' is not one of"):
        EngineConfig.from_kwargs("m", dtype="int8")
