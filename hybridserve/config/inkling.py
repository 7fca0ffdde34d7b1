"""The Inkling checkpoint's `config.json` (model_type "inkling") <-> `ModelConfig`.

`parse_inkling` is registered in `hybridserve.config.hf.PARSERS`; `inkling_config_json` writes
the inverse and refuses a `ModelConfig` the layout cannot express (it checks that parsing what
it wrote gives the config back). The fields are documented in docs/inkling_checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hybridserve.config.errors import ConfigError
from hybridserve.config.fields import Fields, common_fields
from hybridserve.config.layers import (
    AttentionConfig,
    AudioConfig,
    MoeConfig,
    MtpConfig,
    SconvConfig,
    VisionConfig,
)
from hybridserve.config.model import ModelConfig

# The newest layout this build reads and writes; readers refuse newer ones. Bump it when tensors
# are added. 1: the base model and encoders; 2: + the MTP heads (`num_nextn_predict_layers`).
# The writer stores the lowest version that holds the model (1 without MTP heads).
LAYOUT_VERSION = 2
_KINDS = {
    "full_attention": "attention",
    "attention": "attention",
    "sliding_attention": "sliding_attention",
}
_HF_KINDS = {"attention": "full_attention", "sliding_attention": "sliding_attention"}


def _layer_types(f: Fields) -> tuple[str, ...]:
    values = list(f.get("layer_types"))
    bad = sorted({v for v in values if v not in _KINDS})
    if bad:
        raise ConfigError(
            f"{f.where}: field 'layer_types' has unknown layer kinds {bad}; Inkling layers are "
            "'full_attention' or 'sliding_attention'"
        )
    n_layers = f.get("num_hidden_layers", default=len(values))
    if int(n_layers) != len(values):
        raise ConfigError(
            f"{f.where}: field 'num_hidden_layers' ({n_layers}) does not match 'layer_types' "
            f"({len(values)} layers)"
        )
    return tuple(_KINDS[v] for v in values)


def _attention(f: Fields, sliding: bool) -> AttentionConfig:
    heads, hidden = int(f.get("num_attention_heads")), int(f.get("hidden_size"))
    head_dim = int(f.get("head_dim", default=hidden // heads))
    theta = f.get("rope_theta", default=None)  # null: NoPE
    rotary = round(head_dim * float(f.get("partial_rotary_factor", default=1.0)))
    scale = f.get("attention_multiplier", default=None)
    rel_dim = f.get("rel_dim", default=None)
    return AttentionConfig(
        num_heads=heads,
        num_kv_heads=int(f.get("num_key_value_heads", default=heads)),
        head_dim=head_dim,
        scale=None if scale is None else float(scale),
        bias=bool(f.get("attention_bias", default=False)),
        rope_theta=None if theta is None else float(theta),
        rotary_dim=None if theta is None else rotary,
        sliding_window=int(f.get("sliding_window")) if sliding else None,
        rel_dim=None if rel_dim is None else int(rel_dim),
        rel_buckets=int(f.get("rel_buckets", default=32)),
        rel_exact=int(f.get("rel_exact", default=16)),
        rel_max_distance=int(f.get("rel_max_distance", default=4096)),
    )


def _moe(f: Fields) -> MoeConfig:
    return MoeConfig(
        num_experts=int(f.get("n_routed_experts")),
        top_k=int(f.get("num_experts_per_tok")),
        intermediate_size=int(f.get("moe_intermediate_size")),
        router="softmax_sink",
        activation=f.activation("hidden_act", default="silu"),
        gated=bool(f.get("gated_mlp", default=True)),
        shared_intermediate_size=int(f.get("shared_intermediate_size")),
        num_shared_experts=int(f.get("n_shared_experts")),
        expert_format=str(f.get("expert_format", default="dense")),
    )


def _sub(f: Fields, name: str) -> Fields | None:
    raw = f.get(name, default=None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{f.where}: field {name!r} must be an object")
    return Fields(raw, f"{f.where} {name}")


def _vision(f: Fields) -> VisionConfig | None:
    v = _sub(f, "vision_config")
    if v is None:
        return None
    return VisionConfig(
        placeholder_id=int(f.get("image_token_id")),
        sub_patch=int(v.get("sub_patch_size")),
        widths=tuple(int(w) for w in v.get("hidden_sizes")),
        channels=int(v.get("num_channels", default=3)),
    )


def _audio(f: Fields) -> AudioConfig | None:
    a = _sub(f, "audio_config")
    if a is None:
        return None
    lo, hi = a.get("dmel_range")
    return AudioConfig(
        placeholder_id=int(f.get("audio_token_id")),
        sample_rate=int(a.get("sampling_rate")),
        n_fft=int(a.get("n_fft")),
        hop=int(a.get("hop_length")),
        n_mels=int(a.get("num_mel_bins")),
        mel_bins=int(a.get("dmel_levels")),
        mel_range=(float(lo), float(hi)),
    )


def _mtp(f: Fields) -> MtpConfig | None:
    n = int(f.get("num_nextn_predict_layers", default=0))
    if n < 0:
        raise ConfigError(f"{f.where}: field 'num_nextn_predict_layers' = {n} must be >= 0")
    return MtpConfig(num_heads=n) if n else None


def parse_inkling(f: Fields) -> ModelConfig:
    """An Inkling `config.json` (as `Fields`) -> `ModelConfig`; errors name the field."""
    version = int(f.get("layout_version", default=1))
    if version > LAYOUT_VERSION:
        raise ConfigError(
            f"{f.where}: field 'layout_version' = {version}; this build reads Inkling layouts up "
            f"to {LAYOUT_VERSION}"
        )
    kinds = _layer_types(f)
    width = f.get("sconv_width", default=None)
    return ModelConfig(
        layer_types=kinds,
        ffn="moe",
        attention=_attention(f, "sliding_attention" in kinds),
        moe=_moe(f),
        sconv=None
        if width is None
        else SconvConfig(int(width), bool(f.get("sconv_bias", default=False))),
        vision=_vision(f),
        audio=_audio(f),
        mtp=_mtp(f),
        embedding_multiplier=float(f.get("embedding_multiplier", default=1.0)),
        residual_multiplier=float(f.get("residual_multiplier", default=1.0)),
        logits_scaling=float(f.get("logits_scaling", default=1.0)),
        **common_fields(f, "inkling", "rms_norm_eps"),
    )


def _encoders(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"vision_config": None, "audio_config": None}
    if cfg.vision is not None:
        v = cfg.vision
        out["image_token_id"] = v.placeholder_id
        out["vision_config"] = {
            "model_type": "hmlp",
            "num_channels": v.channels,
            "sub_patch_size": v.sub_patch,
            "hidden_sizes": list(v.widths),
        }
    if cfg.audio is not None:
        a = cfg.audio
        out["audio_token_id"] = a.placeholder_id
        out["audio_config"] = {
            "model_type": "dmel",
            "sampling_rate": a.sample_rate,
            "n_fft": a.n_fft,
            "hop_length": a.hop,
            "num_mel_bins": a.n_mels,
            "dmel_levels": a.mel_bins,
            "dmel_range": list(a.mel_range),
        }
    return out


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix[:-1]} ({a!r}, stored as {b!r})"]


def inkling_config_json(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg` as an Inkling `config.json` dict. Raises ConfigError naming the fields of `cfg`
    that the layout cannot store (e.g. another router, a latent projection, mamba layers)."""
    a, m = cfg.attention, cfg.moe
    if cfg.architecture != "inkling" or a is None or m is None or cfg.ffn != "moe":
        raise ConfigError(
            "the Inkling layout stores architecture 'inkling' models with attention mixers and "
            f"an MoE ffn; got architecture={cfg.architecture!r}, ffn={cfg.ffn!r}"
        )
    raw: dict[str, Any] = {
        "architectures": ["InklingForCausalLM"],
        "model_type": "inkling",
        "layout_version": 1 if cfg.mtp is None else 2,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": [_HF_KINDS.get(k, k) for k in cfg.layer_types],
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.dtype,
        "embedding_multiplier": cfg.embedding_multiplier,
        "residual_multiplier": cfg.residual_multiplier,
        "logits_scaling": cfg.logits_scaling,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "attention_multiplier": a.scale,
        "attention_bias": a.bias,
        "rope_theta": a.rope_theta,
        "partial_rotary_factor": None if a.rope_theta is None else a.rotary_dim / a.head_dim,
        "sliding_window": a.sliding_window,
        "rel_dim": a.rel_dim,
        "rel_buckets": a.rel_buckets,
        "rel_exact": a.rel_exact,
        "rel_max_distance": a.rel_max_distance,
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.intermediate_size,
        "n_shared_experts": m.num_shared_experts,
        "shared_intermediate_size": m.shared_intermediate_size,
        "hidden_act": m.activation,
        "gated_mlp": m.gated,
        "expert_format": m.expert_format,
        "sconv_width": None if cfg.sconv is None else cfg.sconv.width,
        "sconv_bias": cfg.sconv is not None and cfg.sconv.bias,
        "num_nextn_predict_layers": 0 if cfg.mtp is None else cfg.mtp.num_heads,
        **_encoders(cfg),
    }
    try:
        back = parse_inkling(Fields(json.loads(json.dumps(raw)), "inkling export"))
    except ConfigError as err:
        raise ConfigError(f"the Inkling layout cannot store this config: {err}") from None
    if back != cfg:
        diff = _differences(dataclasses.asdict(cfg), dataclasses.asdict(back))
        raise ConfigError(f"the Inkling layout cannot store these config fields: {diff}")
    return raw
