"""Model configs and rank layouts for the disagg descriptor tests (pure Python, no JAX)."""

from __future__ import annotations

from hybridserve.cache.plan import CachePlan, plan_cache
from hybridserve.cache.spec import layer_specs
from hybridserve.config import AttentionConfig, MambaConfig, ModelConfig, MoeConfig
from hybridserve.disagg.descriptors import RankLayout

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
KINDS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp", "S": "sliding_attention"}


def nano_config() -> ModelConfig:
    """NVIDIA-Nemotron-3-Nano-30B-A3B: hidden 2688, 32 q / 2 KV heads of 128, Mamba2 64 heads
    of 64, 8 groups, state 128, conv width 4."""
    return ModelConfig(
        architecture="NemotronHForCausalLM",
        vocab_size=131072,
        hidden_size=2688,
        layer_types=tuple(KINDS[c] for c in NANO_PATTERN),
        norm_eps=1e-5,
        attention=AttentionConfig(num_heads=32, num_kv_heads=2, head_dim=128),
        mamba=MambaConfig(
            num_heads=64, head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=128
        ),
        moe=MoeConfig(num_experts=128, top_k=6, intermediate_size=1856),
    )


def tiny_config(
    kv_heads: int = 2,
    n_groups: int = 2,
    pattern: str = "M*MM*M",
    mamba_heads: int = 4,
    conv_kernel: int = 3,
    window: int | None = None,
) -> ModelConfig:
    """A small hybrid: 4 q heads of 2, Mamba2 heads of 2, state 2 (pattern letters as Nano, S:
    sliding-window attention over `window` tokens)."""
    has = set(pattern)
    return ModelConfig(
        architecture="NemotronHForCausalLM",
        vocab_size=64,
        hidden_size=8,
        layer_types=tuple(KINDS[c] for c in pattern),
        norm_eps=1e-5,
        attention=AttentionConfig(
            num_heads=4, num_kv_heads=kv_heads, head_dim=2, sliding_window=window
        )
        if has & {"*", "S"}
        else None,
        mamba=MambaConfig(
            num_heads=mamba_heads,
            head_dim=2,
            state_size=2,
            n_groups=n_groups,
            conv_kernel=conv_kernel,
            chunk_size=4,
        )
        if "M" in has
        else None,
    )


def make_plan(
    cfg: ModelConfig, tp: int, kv_dtype: str = "fp8", layout: str = "DS", kernel_block: int = 16
) -> CachePlan:
    specs = layer_specs(cfg, tp, kv_dtype, "bfloat16", "float32", layout)
    return plan_cache(specs, tp, kernel_block)


def base_of(side: int, rank: int, region: int) -> int:
    """A fake, distinct region base address per (side, rank, region)."""
    return (side << 46) + (rank << 42) + ((region + 1) << 37)


def make_layout(
    cfg: ModelConfig,
    tp: int,
    rank: int,
    num_pages: int = 10,
    side: int = 0,
    kv_dtype: str = "fp8",
    layout: str = "DS",
    kernel_block: int = 16,
) -> RankLayout:
    plan = make_plan(cfg, tp, kv_dtype, layout, kernel_block)
    bases = [base_of(side, rank, i) for i in range(plan.num_regions)]
    return RankLayout.from_plan(
        plan, cfg, tp_rank=rank, region_bases=bases, num_pages=num_pages, device_id=rank
    )


def nano(tp: int, rank: int = 0, num_pages: int = 10, side: int = 0, **kw) -> RankLayout:
    return make_layout(nano_config(), tp, rank, num_pages, side, **kw)


def prefill_ranks(cfg: ModelConfig, tp: int, **kw) -> dict[int, RankLayout]:
    """Every rank of a prefill engine (side 1)."""
    return {q: make_layout(cfg, tp, q, side=1, **kw) for q in range(tp)}
