"""An MoE layer with NVFP4 routed experts equals the same layer with the dequantised weights
(the fused op against dequantise-then-matmul at the layer level), xla and pallas backends,
float32 within 1e-5 of the output scale."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from backends import nvfp4
from backends.protocol import load_ops
from hybridserve.config import ConfigError, MoeConfig
from hybridserve.layers.moe import Moe, Nvfp4Experts


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("router", ["softmax_sink", "sigmoid_group"])
def test_nvfp4_experts_equal_their_dequantised_weights(backend, router):
    kw = dict(num_experts=6, top_k=2, intermediate_size=64, router=router, activation="silu",
              gated=True, shared_intermediate_size=32, num_shared_experts=2 if router ==
              "softmax_sink" else 1)  # fmt: skip
    hidden, ops = 32, load_ops(backend)
    q = Moe(hidden, MoeConfig(**kw, expert_format="nvfp4"), ops, dtype=jnp.float32,
            rngs=nnx.Rngs(0))  # fmt: skip
    dense = Moe(hidden, MoeConfig(**kw), ops, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert isinstance(q.up, Nvfp4Experts) and q.up.codes[...].dtype == jnp.uint8
    for name in ("up", "gate", "down"):
        experts = getattr(q, name)
        w = nvfp4.Nvfp4Weight(experts.codes[...], experts.scales[...], experts.tensor_scale[...])
        getattr(dense, name)[...] = nvfp4.dequantize(w)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 7, hidden)), jnp.float32)
    got, want = np.asarray(q(x)), np.asarray(dense(x))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # Same routing as the original dense layer, the expert weights only 4-bit close to it.
    orig = np.asarray(Moe(hidden, MoeConfig(**kw), ops, dtype=jnp.float32, rngs=nnx.Rngs(0))(x))
    assert 0 < np.abs(orig - got).max() < 0.3 * np.abs(orig).max()


def test_nvfp4_needs_whole_blocks():
    with pytest.raises(ConfigError, match="multiples of 32"):
        MoeConfig(num_experts=4, top_k=2, intermediate_size=48, expert_format="nvfp4")
    with pytest.raises(ConfigError, match="expert_format"):
        MoeConfig(num_experts=4, top_k=2, intermediate_size=64, expert_format="fp4")
