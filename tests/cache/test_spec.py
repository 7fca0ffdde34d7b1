"""Cache specs, grouping and page unification on NVIDIA-Nemotron-3-Nano-30B-A3B, checked against
numbers worked out by hand from its config (and vLLM's test constants, see
shared/reference/nixl_hybrid_spec.md 2.10), plus the grouping rule and its errors."""

from __future__ import annotations

import pytest

from hybridserve.cache.plan import group_layers, plan_cache
from hybridserve.cache.spec import CONV_LAYOUT_ENV, FullAttentionSpec, MambaSpec, layer_specs
from hybridserve.config import (
    AttentionConfig,
    ConfigError,
    MambaConfig,
    ModelConfig,
    MoeConfig,
)
from hybridserve.core.prefix_cache import prefix_unit

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
KINDS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def hybrid(
    pattern: str, kv_heads: int = 2, q_heads: int = 32, mamba_heads: int = 64
) -> ModelConfig:
    """Nemotron-3-Nano-30B-A3B's dimensions (hidden 2688; 32 query / 2 KV heads of 128; Mamba2
    with 64 heads of 64, 8 groups, state 128, conv width 4) on any layer pattern."""
    return ModelConfig(
        architecture="NemotronHForCausalLM",
        vocab_size=131072,
        hidden_size=2688,
        layer_types=tuple(KINDS[c] for c in pattern),
        norm_eps=1e-5,
        attention=AttentionConfig(num_heads=q_heads, num_kv_heads=kv_heads, head_dim=128),
        mamba=MambaConfig(
            num_heads=mamba_heads,
            head_dim=64,
            state_size=128,
            n_groups=8,
            conv_kernel=4,
            chunk_size=128,
        ),
        moe=MoeConfig(num_experts=128, top_k=6, intermediate_size=1856),
    )


def nano_plan(tp: int, kv_dtype: str = "fp8"):
    return plan_cache(layer_specs(hybrid(NANO_PATTERN), tp, kv_dtype, "bfloat16"), tp)


def test_nano_pattern_counts():
    cfg = hybrid(NANO_PATTERN)
    assert cfg.num_layers == 52
    assert [cfg.layer_types.count(k) for k in ("mamba", "attention", "moe")] == [23, 6, 23]


def test_nano_forms_five_groups_over_six_regions():
    plan = nano_plan(1)
    mamba_layers = [i for i, c in enumerate(NANO_PATTERN) if c == "M"]
    attention_layers = [i for i, c in enumerate(NANO_PATTERN) if c == "*"]
    assert plan.num_regions == 6
    assert [g.kind for g in plan.groups] == ["mamba"] * 4 + ["full_attention"]
    for g in range(4):  # 23 Mamba layers by stride into 4 groups of 6, 6, 6, 5 + 1 padding
        members = mamba_layers[g::4]
        assert plan.groups[g].layers == tuple(members) + (None,) * (6 - len(members))
    assert plan.groups[4].layers == tuple(attention_layers)
    assert all(g.spec.page_size_bytes == plan.page_size_bytes for g in plan.groups)
    assert plan.region_of(attention_layers[2]) == 2 and plan.group_of(mamba_layers[5]) == 1


@pytest.mark.parametrize(
    "tp,state,conv,block,ratio,page",
    [  # the table of nixl_hybrid_spec.md 2.10 (fp8 KV, kernel block 16)
        (1, 2_134_016, 36_864, 4176, 261, 2_138_112),
        (2, 1_067_008, 18_432, 4176, 261, 1_069_056),
        (4, 533_504, 9_216, 2096, 131, 536_576),
        (8, 266_752, 4_608, 1056, 66, 270_336),
    ],
)
def test_nano_state_bytes_and_page_unification(tp, state, conv, block, ratio, page):
    conv_dim = 64 * 64 + 2 * 8 * 128  # x, then B and C of 8 groups x 128
    assert conv == conv_dim // tp * 3 * 2  # (W - 1) rows of bf16
    assert state == conv + 64 // tp * 64 * 128 * 4  # + ssm (heads, head_dim, state) float32
    kv_per_token = max(1, 2 // tp) * 2 * 128 * 1  # K and V of the local KV heads, fp8
    assert block == 16 * -(-state // (16 * kv_per_token)) and page == block * kv_per_token
    plan = nano_plan(tp)
    spec = plan.groups[0].spec
    assert isinstance(spec, MambaSpec)
    assert (spec.state_bytes, spec.conv_bytes, spec.conv_shape) == (
        state,
        conv,
        (conv_dim // tp, 3),
    )
    assert (plan.block_size, plan.ratio, plan.page_size_bytes) == (block, ratio, page)
    assert spec.page_size_bytes == page and plan.kernel_block_size == 16


def test_nano_bf16_kv_halves_the_block():
    plan = nano_plan(1, "bfloat16")
    assert (plan.block_size, plan.ratio) == (2096, 131)  # 16 * ceil(2_134_016 / (16 * 1024))


def test_sd_conv_layout_from_the_environment(monkeypatch):
    monkeypatch.setenv(CONV_LAYOUT_ENV, "SD")
    spec = nano_plan(1).groups[0].spec
    assert spec.layout == "SD" and spec.conv_shape == (3, 6144) and spec.conv_bytes == 36_864
    assert spec.state_bytes == 2_134_016
    monkeypatch.setenv(CONV_LAYOUT_ENV, "XY")
    with pytest.raises(ConfigError, match=CONV_LAYOUT_ENV):
        nano_plan(1)


def test_nano_prefix_unit():
    plan = nano_plan(1)
    unit = prefix_unit(plan)
    assert unit == 144 == 16 * 9 and plan.block_size % unit == 0  # 261 = 9 x 29


def test_group_size_rule():
    m = MambaSpec(64, 16, 3, "bfloat16", (1, 64, 16), "float32")
    a = FullAttentionSpec(1, 64, "bfloat16")
    # 4 and 3 layers: 4 < 1.5 x 3, so groups of 4 (the attention group padded)
    groups = group_layers([m] * 4 + [a] * 3)
    assert [g.layers for g in groups] == [(0, 1, 2, 3), (4, 5, 6, None)]
    # 7 and 2 layers: groups of 2, the Mamba layers by stride into 4 groups
    groups = group_layers([m] * 7 + [None] + [a] * 2)
    assert [g.layers for g in groups] == [(0, 4), (1, 5), (2, 6), (3, None), (8, 9)]
    assert [g.kind for g in groups] == ["mamba"] * 4 + ["full_attention"]


def test_incompatible_tensor_parallel_size_names_the_field():
    cfg = hybrid("M*M*", kv_heads=3, q_heads=24)
    assert layer_specs(cfg, 1, "fp8", "bfloat16")[1].num_kv_heads == 3
    with pytest.raises(ConfigError, match="num_key_value_heads = 3 .* tensor_parallel_size 2"):
        layer_specs(cfg, 2, "fp8", "bfloat16")
    with pytest.raises(ConfigError, match="mamba num_heads = 64 .* tensor_parallel_size 3"):
        layer_specs(hybrid("M*"), 3, "fp8", "bfloat16")
    with pytest.raises(ConfigError, match="mamba n_groups = 8 .* tensor_parallel_size 3"):
        layer_specs(hybrid("M*", mamba_heads=48), 3, "fp8", "bfloat16")
