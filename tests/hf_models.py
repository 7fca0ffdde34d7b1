"""Tiny random Hugging Face checkpoints built with transformers, for parity tests.

Weights are redrawn at O(1) scale (the stock 0.02 init gives near-constant logits, a weak test):
linear weights N(0, 1/fan_in); A = -U[1, 16]; D ~ U[0.5, 1.5]; softplus(dt_bias) ~ U[0.03, 0.3]
(above the 1e-3 dt clamp of transformers' nemotron_h prefill path, which we do not apply);
norm weights 1 +- 0.1; biases 0.1 N(0, 1).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MAMBA_NH = dict(
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8
)
MAMBA_GRANITE = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    mamba_expand=2,
)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2)


def nemotron_h_config(latent: bool = False):
    from transformers import NemotronHConfig

    pattern = "ME*E" if latent else "M-M*EM*E"
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    extra = (
        dict(
            moe_latent_size=32,
            n_group=2,
            topk_group=1,
            num_key_value_heads=1,
            n_groups=4,
            mamba_head_dim=8,
            routed_scaling_factor=1.5,
        )
        if latent
        else {}
    )
    kw = {
        **COMMON,
        **MAMBA_NH,
        **ATTN,
        "head_dim": 16,
        "intermediate_size": 96,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "routed_scaling_factor": 2.5,
        "layers_block_type": [kinds[c] for c in pattern],
        **extra,
    }
    return NemotronHConfig(**kw)


def bamba_config():
    from transformers import BambaConfig

    return BambaConfig(
        **COMMON,
        **ATTN,
        **MAMBA_GRANITE,
        num_hidden_layers=6,
        attn_layer_indices=[2, 5],
        intermediate_size=96,
    )


def granite_config(rope: bool = False):
    from transformers import GraniteMoeHybridConfig

    kinds = ["linear_attention" if c == "M" else "full_attention" for c in "MM*MM*"]
    return GraniteMoeHybridConfig(
        **COMMON,
        **ATTN,
        **MAMBA_GRANITE,
        num_hidden_layers=6,
        layer_types=kinds,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.125,
        logits_scaling=4.0,
        position_embedding_type="rope" if rope else None,
    )


def redraw(model: torch.nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter at O(1) scale (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif leaf == "D":
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif leaf == "dt_bias":
                dt = 0.03 + 0.27 * torch.rand(p.shape, generator=gen)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif "norm" in name or "layernorm" in name:
                p.copy_(1 + 0.1 * (2 * torch.rand(p.shape, generator=gen) - 1))
            elif leaf in ("bias", "e_score_correction_bias") or p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if "conv1d" not in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


def build(config, directory: Path, seed: int = 0, max_shard_size: str | None = None):
    """Instantiate the causal LM of `config`, redraw its weights, save it; return the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    redraw(model, seed)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kw)
    return model


FAMILIES = {
    "nemotron_h": nemotron_h_config,
    "nemotron_h_latent": lambda: nemotron_h_config(latent=True),
    "bamba": bamba_config,
    "granitemoehybrid": granite_config,
    "granitemoehybrid_rope": lambda: granite_config(rope=True),
}
