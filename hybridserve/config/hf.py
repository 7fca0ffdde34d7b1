"""Hugging Face `config.json` -> `ModelConfig`, for nemotron_h, bamba and granitemoehybrid, and
our own Inkling layout (model_type "inkling", parsed in `hybridserve.config.inkling`).

Accepts both forms of the Nemotron-H layer layout (the `layers_block_type` list and the legacy
`hybrid_override_pattern` string), legacy field aliases, and the `{"__float__": "Infinity"}`
encoding transformers writes for infinite floats. A missing or inconsistent field raises
`ConfigError` naming the field. A ModelOpt-quantised checkpoint's `quantization_config` /
`hf_quant_config.json` becomes `ModelConfig.quant` (`hybridserve.config.quant`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from hybridserve.config.errors import ConfigError
from hybridserve.config.fields import Fields, common_fields, load_hf_json
from hybridserve.config.inkling import parse_inkling
from hybridserve.config.layers import AttentionConfig, MambaConfig, MlpConfig, MoeConfig, MtpConfig
from hybridserve.config.model import ModelConfig
from hybridserve.config.quant import parse_quant


def _mamba(
    f: Fields,
    num_heads: str,
    head_dim: int,
    state: str,
    groups: tuple[str, ...],
    conv: tuple[str, ...],
    chunk: tuple[str, ...],
    conv_bias: tuple[str, ...],
    proj_bias: tuple[str, ...],
) -> MambaConfig:
    limit = f.get("time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))
    if len(limit) != 2 or not limit[0] <= limit[1]:
        raise ConfigError(f"{f.where}: field 'time_step_limit' must be [min, max], got {limit}")
    return MambaConfig(
        num_heads=int(f.get(num_heads)),
        head_dim=head_dim,
        state_size=int(f.get(state)),
        n_groups=int(f.get(*groups)),
        conv_kernel=int(f.get(*conv)),
        chunk_size=int(f.get(*chunk)),
        use_conv_bias=bool(f.get(*conv_bias, default=True)),
        use_bias=bool(f.get(*proj_bias, default=False)),
        dt_min=float(limit[0]),
        dt_max=float(limit[1]),
    )


def _rope(f: Fields, head_dim: int, partial: float) -> tuple[float, int]:
    params = f.get("rope_parameters", default=None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{f.where}: field 'rope_parameters.rope_type' = {rope_type!r} is not "
            "supported (only 'default')"
        )
    theta = params.get("rope_theta", f.get("rope_theta", default=10000.0))
    return float(theta), int(head_dim * partial)


def _attention(f: Fields, **extra: Any) -> AttentionConfig:
    heads = int(f.get("num_attention_heads"))
    hidden = int(f.get("hidden_size"))
    head_dim = int(f.get("head_dim", default=hidden // heads))
    return AttentionConfig(
        num_heads=heads,
        num_kv_heads=int(f.get("num_key_value_heads", default=heads)),
        head_dim=head_dim,
        **extra,
    )


def _nemotron_h(f: Fields) -> ModelConfig:
    if "layers_block_type" in f.raw or "layer_types" in f.raw:
        name = "layers_block_type" if "layers_block_type" in f.raw else "layer_types"
        kinds = f.kinds(name, list(f.get(name)))
    elif "hybrid_override_pattern" in f.raw:
        kinds = f.kinds("hybrid_override_pattern", list(f.get("hybrid_override_pattern")))
    else:
        raise ConfigError(
            f"{f.where}: missing field 'layers_block_type' (or the legacy "
            "'hybrid_override_pattern')"
        )
    n_layers = f.get("num_hidden_layers", default=None)
    if isinstance(n_layers, int) and "hybrid_override_pattern" in f.raw and n_layers != len(kinds):
        raise ConfigError(
            f"{f.where}: field 'num_hidden_layers' ({n_layers}) does not match "
            f"'hybrid_override_pattern' ({len(kinds)} layers)"
        )
    mamba = attention = mlp = moe = None
    if "mamba" in kinds:
        mamba = _mamba(
            f,
            "mamba_num_heads",
            int(f.get("mamba_head_dim")),
            "ssm_state_size",
            ("n_groups", "mamba_n_groups"),
            ("conv_kernel", "mamba_d_conv"),
            ("chunk_size", "mamba_chunk_size"),
            ("use_conv_bias", "mamba_conv_bias"),
            ("use_bias",),
        )
    mtp = _nemotron_mtp(f)
    used = set(kinds) | ({"attention", mtp.ffn} if mtp is not None else set())
    if "attention" in used:
        attention = _attention(f)  # NoPE; q/k/v/o carry no bias in this family
    act = f.activation("mlp_hidden_act", default="relu2")
    mlp_bias = bool(f.get("mlp_bias", default=False))
    if "mlp" in used:
        mlp = MlpConfig(int(f.get("intermediate_size")), activation=act, bias=mlp_bias)
    if "moe" in used:
        moe = MoeConfig(
            num_experts=int(f.get("n_routed_experts", "num_local_experts")),
            top_k=int(f.get("num_experts_per_tok")),
            intermediate_size=int(f.get("moe_intermediate_size")),
            router="sigmoid_group",
            activation=act,
            bias=mlp_bias,
            shared_intermediate_size=int(f.get("moe_shared_expert_intermediate_size", default=0)),
            n_group=int(f.get("n_group", default=1)),
            topk_group=int(f.get("topk_group", default=1)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            latent_size=f.get("moe_latent_size", default=None),
        )
    return ModelConfig(
        layer_types=kinds,
        attention=attention,
        mamba=mamba,
        mlp=mlp,
        moe=moe,
        mtp=mtp,
        **common_fields(f, "nemotron_h", "layer_norm_epsilon"),
    )


def _nemotron_mtp(f: Fields) -> MtpConfig | None:
    """Nemotron-H's MTP layers: `num_nextn_predict_layers` steps, each an attention layer then
    an ffn layer (`mtp_layers_block_type`, or the legacy `mtp_hybrid_override_pattern`, "*E"
    by default): one `MtpHead` each (`weights.hf_names` maps `mtp.layers.*`)."""
    n = int(f.get("num_nextn_predict_layers", default=0) or 0)
    if n < 0:
        raise ConfigError(f"{f.where}: field 'num_nextn_predict_layers' = {n} must be >= 0")
    if n == 0:
        return None
    if "mtp_layers_block_type" in f.raw:
        name, values = "mtp_layers_block_type", list(f.get("mtp_layers_block_type"))
    else:
        name = "mtp_hybrid_override_pattern"
        values = list(f.get(name, default="*E"))
    kinds = f.kinds(name, values)
    if len(kinds) != 2 or kinds[0] != "attention" or kinds[1] not in ("mlp", "moe"):
        raise ConfigError(
            f"{f.where}: field {name!r} = {values!r}: only an attention layer followed by an "
            "mlp or moe layer is supported for MTP"
        )
    return MtpConfig(num_heads=n, ffn=kinds[1])


def _granite_family_mamba(f: Fields) -> MambaConfig:
    heads = int(f.get("mamba_n_heads"))
    head_dim = f.get("mamba_d_head", default="auto")
    if head_dim == "auto":
        head_dim = int(f.get("mamba_expand", default=2)) * int(f.get("hidden_size")) // heads
    return _mamba(
        f,
        "mamba_n_heads",
        int(head_dim),
        "mamba_d_state",
        ("mamba_n_groups",),
        ("mamba_d_conv",),
        ("mamba_chunk_size",),
        ("mamba_conv_bias",),
        ("mamba_proj_bias",),
    )


def _bamba(f: Fields) -> ModelConfig:
    n_layers = int(f.get("num_hidden_layers"))
    attn_idx = set(f.get("attn_layer_indices", default=[]))
    if any(not 0 <= i < n_layers for i in attn_idx):
        raise ConfigError(
            f"{f.where}: field 'attn_layer_indices' {sorted(attn_idx)} is out of "
            f"range for num_hidden_layers={n_layers}"
        )
    kinds = tuple("attention" if i in attn_idx else "mamba" for i in range(n_layers))
    attention = None
    if attn_idx:
        probe = _attention(f)
        # transformers hard-codes partial_rotary_factor = 0.5 for Bamba.
        theta, rotary_dim = _rope(f, probe.head_dim, 0.5)
        attention = _attention(
            f,
            bias=bool(f.get("attention_bias", default=False)),
            rope_theta=theta,
            rotary_dim=rotary_dim,
        )
    mlp = MlpConfig(
        int(f.get("intermediate_size")),
        activation=f.activation("hidden_act", default="silu"),
        gated=True,
        bias=bool(f.get("mlp_bias", default=False)),
    )
    mamba = _granite_family_mamba(f) if "mamba" in kinds else None
    return ModelConfig(
        layer_types=kinds,
        ffn="mlp",
        attention=attention,
        mamba=mamba,
        mlp=mlp,
        **common_fields(f, "bamba", "rms_norm_eps"),
    )


def _granitemoehybrid(f: Fields) -> ModelConfig:
    name = "layer_types" if "layer_types" in f.raw else "layers_block_type"
    kinds = f.kinds(name, list(f.get(name)))
    bad = sorted(set(kinds) - {"mamba", "attention"})
    if bad:
        raise ConfigError(
            f"{f.where}: field {name!r} may hold only mamba/attention layers, got {bad}"
        )
    act = f.activation("hidden_act", default="silu")
    attention = None
    if "attention" in kinds:
        rope = f.get("position_embedding_type", default=None)
        if rope not in (None, "nope", "rope"):
            raise ConfigError(
                f"{f.where}: field 'position_embedding_type' = {rope!r} is not supported"
            )
        extra: dict[str, Any] = {}
        if rope == "rope":
            extra["rope_theta"], extra["rotary_dim"] = _rope(f, _attention(f).head_dim, 1.0)
        attention = _attention(
            f,
            scale=float(f.get("attention_multiplier")),
            bias=bool(f.get("attention_bias", default=False)),
            **extra,
        )
    shared = int(f.get("shared_intermediate_size"))
    n_experts = int(f.get("num_local_experts", default=0))
    mlp = moe = None
    if n_experts > 0:
        moe = MoeConfig(
            num_experts=n_experts,
            top_k=int(f.get("num_experts_per_tok")),
            intermediate_size=int(f.get("intermediate_size")),
            router="softmax_topk",
            activation=act,
            gated=True,
            shared_intermediate_size=shared,
        )
    else:
        mlp = MlpConfig(shared, activation=act, gated=True)
    mamba = _granite_family_mamba(f) if "mamba" in kinds else None
    return ModelConfig(
        layer_types=kinds,
        ffn="moe" if moe else "mlp",
        attention=attention,
        mamba=mamba,
        mlp=mlp,
        moe=moe,
        embedding_multiplier=float(f.get("embedding_multiplier", default=1.0)),
        residual_multiplier=float(f.get("residual_multiplier", default=1.0)),
        logits_scaling=float(f.get("logits_scaling", default=1.0)),
        **common_fields(f, "granitemoehybrid", "rms_norm_eps"),
    )


PARSERS = {
    "nemotron_h": _nemotron_h,
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "inkling": parse_inkling,
}


def parse_hf_config(path: str | Path) -> ModelConfig:
    """Parse an HF config of a supported family into a `ModelConfig`."""
    raw = load_hf_json(path)
    model_type = raw.get("model_type")
    if model_type not in PARSERS:
        raise ConfigError(
            f"{path}: unsupported model_type {model_type!r}; supported: {sorted(PARSERS)}"
        )
    cfg = PARSERS[model_type](Fields(raw, f"{path} ({model_type})"))
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    quant = parse_quant(raw, directory)
    if quant is None:
        return cfg
    if model_type == "inkling":
        raise ConfigError(
            f"{path}: quantised checkpoints of model_type 'inkling' are not supported"
        )
    return dataclasses.replace(cfg, quant=quant)
