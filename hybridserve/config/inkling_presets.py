"""Inkling model presets: configs built from the dataclasses (no files), and their parameter
counts.

`inkling_full()`: 66 layers (every 6th, layers 5, 11, ..., 65, full attention; the other 55
sliding-window attention over 4096 tokens), hidden 7168, vocab 163840, GQA 64 query / 8 KV
heads of 128 (NoPE, relative term rel_dim 64), an expert-sink MoE of 256 routed experts (top-6,
intermediate 2048) and 2 shared experts (intermediate 2048), gated silu, sconv width 4, bf16,
max 1M positions. Parameters (`param_count`): 763,050,396,672 (763.1 B; 1.53 TB in bf16, of
which the routed experts 744.1 B); active per token (`active_param_count`: all but the 250
routed experts per layer a token skips): 36,387,228,672 (36.4 B with the embedding and lm_head;
34.0 B without them).

`inkling_mid()`: a random-weight benchmark size for one H200 in bf16: 12 layers (5 and 11 full,
the rest sliding over 1024 tokens), hidden 2048, vocab 163840, GQA 16 query / 4 KV heads of 128
(relative term rel_dim 64), 64 routed experts (top-6, intermediate 512) and 2 shared experts
(intermediate 512), sconv width 4, bf16, max 128K positions. Parameters: 3,315,443,712 (3.3 B;
6.6 GB in bf16, of which the routed experts 2.4 B); active per token: 1,126,017,024 (1.13 B;
0.45 B without the embedding and lm_head).
"""

from __future__ import annotations

from hybridserve.config.errors import ConfigError
from hybridserve.config.layers import AttentionConfig, MoeConfig, SconvConfig
from hybridserve.config.model import ModelConfig


def layer_pattern(num_layers: int, every: int = 6) -> tuple[str, ...]:
    """Every `every`-th layer (indices every-1, 2*every-1, ...) full attention, the rest
    sliding-window attention."""
    return tuple(
        "attention" if i % every == every - 1 else "sliding_attention" for i in range(num_layers)
    )


def inkling_full() -> ModelConfig:
    """The full-size Inkling config (numbers in the module docstring)."""
    return ModelConfig(
        architecture="inkling",
        vocab_size=163840,
        hidden_size=7168,
        layer_types=layer_pattern(66),
        norm_eps=1e-6,
        ffn="moe",
        attention=AttentionConfig(
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=None,
            sliding_window=4096,
            rel_dim=64,
            rel_buckets=32,
            rel_exact=16,
            rel_max_distance=4096,
        ),
        moe=MoeConfig(
            num_experts=256,
            top_k=6,
            intermediate_size=2048,
            router="softmax_sink",
            activation="silu",
            gated=True,
            shared_intermediate_size=2048,
            num_shared_experts=2,
        ),
        sconv=SconvConfig(width=4),
        max_position_embeddings=1048576,
        dtype="bfloat16",
    )


def inkling_mid() -> ModelConfig:
    """A mid-size random-weight Inkling for a one-H200 bf16 benchmark (module docstring)."""
    return ModelConfig(
        architecture="inkling",
        vocab_size=163840,
        hidden_size=2048,
        layer_types=layer_pattern(12),
        norm_eps=1e-6,
        ffn="moe",
        attention=AttentionConfig(
            num_heads=16,
            num_kv_heads=4,
            head_dim=128,
            rope_theta=None,
            sliding_window=1024,
            rel_dim=64,
            rel_buckets=32,
            rel_exact=16,
            rel_max_distance=4096,
        ),
        moe=MoeConfig(
            num_experts=64,
            top_k=6,
            intermediate_size=512,
            router="softmax_sink",
            activation="silu",
            gated=True,
            shared_intermediate_size=512,
            num_shared_experts=2,
        ),
        sconv=SconvConfig(width=4),
        max_position_embeddings=131072,
        dtype="bfloat16",
    )


def _check(cfg: ModelConfig) -> None:
    ok = (
        cfg.attention is not None
        and cfg.mamba is None
        and set(cfg.layer_types) <= {"attention", "sliding_attention"}
        and cfg.ffn in (None, "moe")
        and (
            cfg.ffn is None
            or (
                cfg.moe.router == "softmax_sink"
                and cfg.moe.latent_size is None
                and cfg.moe.expert_format == "dense"
            )
        )
    )
    if not ok:
        raise ConfigError(
            "param_count covers Inkling-style configs only: attention mixers, an expert-sink "
            "MoE ffn (or none), no latent projection, dense experts"
        )


def routed_expert_params(cfg: ModelConfig) -> int:
    """Weights of one routed expert of one layer (up, gate when gated, down)."""
    m = cfg.moe
    return (3 if m.gated else 2) * cfg.hidden_size * m.intermediate_size


def layer_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one block, by part (every block has the same shapes)."""
    _check(cfg)
    d, a = cfg.hidden_size, cfg.attention
    n, k, h = a.num_heads, a.num_kv_heads, a.head_dim
    parts = {
        "norms": d * (2 if cfg.ffn else 1),
        "qo": 2 * d * n * h + (n * h + d if a.bias else 0),
        "kv": 2 * d * k * h + (2 * k * h if a.bias else 0),
    }
    if a.rel_dim is not None:
        parts["r"] = d * n * a.rel_dim + (n * a.rel_dim if a.bias else 0)
        parts["rel_table"] = a.rel_buckets * a.rel_dim
    if cfg.ffn == "moe":
        m = cfg.moe
        parts["router"] = d * (m.num_experts + m.num_shared_experts)
        parts["routed_experts"] = m.num_experts * routed_expert_params(cfg)
        parts["shared_experts"] = (
            (3 if m.gated else 2) * m.num_shared_experts * d * m.shared_intermediate_size
        )
    if cfg.sconv is not None:
        w, b = cfg.sconv.width, int(cfg.sconv.bias)
        channels = 2 * k * h + d + (d if cfg.ffn else 0)  # kv, out, ffn sites
        parts["sconv"] = channels * (w + b)
    return parts


def param_count(cfg: ModelConfig) -> int:
    """All decoder parameters (multimodal encoders excluded): embedding, lm_head (unless tied),
    the final norm and every block (`layer_param_counts`)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    outer = v * d * (1 if cfg.tie_word_embeddings else 2) + d
    return outer + cfg.num_layers * sum(layer_param_counts(cfg).values())


def active_param_count(cfg: ModelConfig, with_embeddings: bool = True) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to (the shared
    experts always run). `with_embeddings=False` leaves out the embedding and lm_head."""
    total = param_count(cfg)
    if cfg.ffn == "moe":
        unused = cfg.moe.num_experts - cfg.moe.top_k
        total -= cfg.num_layers * unused * routed_expert_params(cfg)
    if not with_embeddings:
        total -= cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return total
