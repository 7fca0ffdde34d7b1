"""The decode-step byte accounting against hand counts from the published dimensions.

The expected numbers are written from the Nemotron-Nano-9B-v2 and Nemotron-3-Nano-30B-A3B
dimensions alone (formulas below), not from the model code; the model side is the abstract
(shape-only) model, so no weights are allocated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from backends.protocol import load_ops
from hybridserve.cache.plan import make_plan
from hybridserve.config import CacheConfig
from hybridserve.weights.loader import abstract_model, read_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import random_models  # noqa: E402
from decode_cost import cache_bytes, decode_bytes, expert_coverage, weight_bytes  # noqa: E402


def _abstract(shape: str, tmp_path: Path):
    cfg = read_config(random_models.write_config(shape, tmp_path / shape))
    _, state = nnx.split(abstract_model(cfg, load_ops("xla"), jnp.bfloat16))
    return cfg, state


def _mamba_params(d: int, h: int, p: int, g: int, n: int, k: int) -> tuple[int, int]:
    """(bf16 parameters, float32 parameters) of one Mamba2 block, its pre-norm included."""
    conv = h * p + 2 * g * n
    bf16 = d * (2 * h * p + 2 * g * n + h) + conv * k + conv + h * p + h * p * d + d
    return bf16, 3 * h  # A_log, D, dt_bias in float32


def test_nano_9b_weights_match_a_hand_count(tmp_path: Path) -> None:
    cfg, state = _abstract("nano-9b-v2", tmp_path)
    d, v, i = 4480, 131072, 15680
    mamba_bf16, mamba_f32 = _mamba_params(d, 128, 80, 8, 128, 4)
    attention = d * (40 + 2 * 8) * 128 + 40 * 128 * d + d
    mlp = 2 * d * i + d
    bf16 = 27 * mamba_bf16 + 4 * attention + 25 * mlp + d * v + d  # lm_head, final norm
    f32 = 27 * mamba_f32
    assert (bf16 + f32 + v * d) / 1e9 == pytest.approx(8.888, abs=1e-3)  # the published size
    for batch in (1, 64):  # the embedding table contributes its gathered rows only
        expected = 2 * (bf16 + batch * d) + 4 * f32
        assert weight_bytes(cfg, state, batch) == expected


def test_moe_weights_follow_expert_coverage(tmp_path: Path) -> None:
    cfg, state = _abstract("nano-30b-a3b", tmp_path)
    d, e, f = 2688, 128, 1856
    routed = 23 * 2 * e * d * f * 2  # up and down of every routed expert, bf16
    dense_1 = weight_bytes(cfg, state, 1) - routed * expert_coverage(e, 6, 1)
    for batch in (8, 64, 1024):
        got = weight_bytes(cfg, state, batch)
        want = dense_1 + (batch - 1) * d * 2 + routed * expert_coverage(e, 6, batch)
        assert got == pytest.approx(want, abs=2)
    assert expert_coverage(e, 6, 1) == 6 / 128
    # Monte Carlo: each token picks 6 distinct experts of 128 at random
    rng = np.random.default_rng(0)
    picks = [
        len({x for _ in range(32) for x in rng.choice(e, 6, replace=False)}) for _ in range(400)
    ]
    assert np.mean(picks) / e == pytest.approx(expert_coverage(e, 6, 32), rel=0.01)


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_cache_terms_match_a_hand_count(tmp_path: Path, ssm_dtype: str) -> None:
    cfg, state = _abstract("nano-9b-v2", tmp_path)
    plan = make_plan(cfg, CacheConfig(ssm_dtype=ssm_dtype), 1, "bfloat16")
    batch, context = 64, 8192
    s_ssm = 4 if ssm_dtype == "float32" else 2
    ssm = 128 * 80 * 128 * s_ssm
    conv = 3 * (128 * 80 + 2 * 8 * 128) * 2
    kv = 4 * batch * context * 2 * 8 * 128 * 2
    assert cache_bytes(plan, batch, context) == (kv, 27 * batch * 2 * (ssm + conv))
    cost = decode_bytes(cfg, plan, state, batch, context)
    assert cost.total == cost.weights + kv + 27 * batch * 2 * (ssm + conv)
    assert cost.floor_s(4e12) == pytest.approx(cost.total / 4e12)
    if ssm_dtype == "float32":  # performance_and_users.md 2.5: 8.6 GB KV, 18.1 GB SSM state
        assert kv / 1e9 == pytest.approx(8.6, abs=0.05)
        assert 27 * batch * 2 * ssm / 1e9 == pytest.approx(18.1, abs=0.05)


def test_fp8_9b_weights_count_one_byte_per_fp8_value(tmp_path: Path) -> None:
    """The FP8 shape (the Nano FP8 recipe: attention layers, the Mamba2 layer before each, the
    lm_head and conv1d in bf16) reads its FP8 projections at one byte a value plus two float32
    scales per kernel (in_proj is five kernels here: z, x, B, C, dt), the attention layers hold
    their float32 k_scale and v_scale, and the KV cache is e4m3."""
    cfg, state = _abstract("nano-9b-v2-fp8", tmp_path)
    d, v, i, h, p, g, n = 4480, 131072, 15680, 128, 80, 8, 128
    pattern = random_models.NANO_9B_PATTERN
    kept = {j - 1 for j, c in enumerate(pattern) if c == "*" and pattern[j - 1] == "M"}
    mamba_bf16, mamba_f32 = _mamba_params(d, h, p, g, n, 4)
    projections = d * (2 * h * p + 2 * g * n + h) + h * p * d
    attention = d * (40 + 2 * 8) * 128 + 40 * 128 * d + d
    mlp = 2 * d * i + d
    total = 0
    for j, c in enumerate(pattern):
        if c == "M" and j not in kept:  # projections at 1 byte, 6 kernels x 2 scales
            total += 2 * (mamba_bf16 - projections) + projections + 6 * 2 * 4 + 4 * mamba_f32
        elif c == "M":
            total += 2 * mamba_bf16 + 4 * mamba_f32
        elif c == "-":
            total += (mlp - d) + 2 * d + 2 * 2 * 4
        else:
            total += 2 * attention + 2 * 4  # and its k_scale, v_scale
    total += 2 * (d * v + d) + 2 * d  # lm_head and final norm, one gathered embedding row
    assert weight_bytes(cfg, state, 1) == total
    bf16 = _abstract("nano-9b-v2", tmp_path)[1]
    assert weight_bytes(cfg, state, 1) / weight_bytes(cfg, bf16, 1) == pytest.approx(
        0.584, abs=0.005
    )
    plan = make_plan(cfg, CacheConfig(), 1, "bfloat16")
    assert cache_bytes(plan, 1, 1000)[0] == 4 * 1000 * 2 * 8 * 128  # one byte a K/V value
