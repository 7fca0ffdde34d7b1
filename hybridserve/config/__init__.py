"""Every configuration of hybridserve, as frozen dataclasses. Standard library only.

  errors.py           ConfigError, require
  layers.py           the layer configs (AttentionConfig, MambaConfig, MoeConfig, ...)
  model.py            ModelConfig: a layer pattern plus the layer configs
  fields.py           reading an HF-style config.json (shared by the two parsers)
  hf.py               parse_hf_config: HF config.json -> ModelConfig (families and Inkling)
  inkling.py          the Inkling config.json <-> ModelConfig
  inkling_presets.py  Inkling model presets (full size, mid size) and parameter counts
  quant.py            QuantConfig: a ModelOpt FP8 checkpoint's quantisation
  kv_transfer.py      KVTransferConfig (disaggregated prefill/decode)
  engine.py           EngineConfig and its sub-configs, built by EngineConfig.from_kwargs

Submodules import each other directly (never this package), so the re-exports below make no
cycle.
"""

from __future__ import annotations

from hybridserve.config.engine import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SettingError,
    SpeculativeConfig,
)
from hybridserve.config.errors import ConfigError
from hybridserve.config.hf import parse_hf_config
from hybridserve.config.kv_transfer import (
    KV_CONNECTORS,
    KV_ROLES,
    KVTransferConfig,
    is_loopback,
)
from hybridserve.config.layers import (
    ACTIVATIONS,
    LAYER_KINDS,
    ROUTERS,
    AttentionConfig,
    AudioConfig,
    MambaConfig,
    MlpConfig,
    MoeConfig,
    MtpConfig,
    SconvConfig,
    VisionConfig,
)
from hybridserve.config.model import ModelConfig
from hybridserve.config.quant import QuantConfig

__all__ = [
    "ACTIVATIONS",
    "KV_CONNECTORS",
    "KV_ROLES",
    "LAYER_KINDS",
    "ROUTERS",
    "AttentionConfig",
    "AudioConfig",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "KVTransferConfig",
    "MambaConfig",
    "MlpConfig",
    "ModelConfig",
    "MoeConfig",
    "MtpConfig",
    "ParallelConfig",
    "QuantConfig",
    "SchedulerConfig",
    "SconvConfig",
    "SettingError",
    "SpeculativeConfig",
    "VisionConfig",
    "is_loopback",
    "parse_hf_config",
]
