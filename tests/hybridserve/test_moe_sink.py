"""The expert sink: routed and shared experts scored in one softmax, top-k among the routed only,
no renormalisation, the shared experts always on. Router and layer against numpy written from
the docstring equations (float32, within 1e-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from backends.protocol import load_ops
from hybridserve.config import ConfigError, MoeConfig
from hybridserve.layers.moe import Moe, route_sink

E, S, K = 8, 2, 3


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _cfg(**kw) -> MoeConfig:
    base = dict(num_experts=E, top_k=K, intermediate_size=16, router="softmax_sink")
    base.update(activation="silu", gated=True, shared_intermediate_size=12, num_shared_experts=S)
    base.update(kw)
    return MoeConfig(**base)


def test_sink_router_scores_shared_experts_but_never_selects_them():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, E + S)) * 2
    logits[:16, E:] += 20.0  # tokens whose shared experts dominate: still no shared id
    weights, ids, sink = (np.asarray(a) for a in route_sink(_cfg(), jnp.asarray(logits)))
    p = _softmax(logits.astype(np.float64))
    assert ids.shape == (64, K) and (ids < E).all() and (ids >= 0).all()
    assert all(len(set(row)) == K for row in ids)
    # The chosen are the k most probable routed experts, with their probabilities over all E + S
    # (the shared experts are in the denominator): no renormalisation.
    np.testing.assert_array_equal(np.sort(ids, 1), np.sort(np.argsort(-p[:, :E], 1)[:, :K], 1))
    np.testing.assert_allclose(weights, np.take_along_axis(p, ids, 1), rtol=1e-5)
    np.testing.assert_allclose(sink, p[:, E:], rtol=1e-5)
    # All routed probabilities sum to one minus the sink mass; the chosen ones to less.
    np.testing.assert_allclose(p[:, :E].sum(1), 1 - sink.sum(1), atol=1e-6)
    assert (weights.sum(1) <= 1 - sink.sum(1) + 1e-6).all()
    assert (weights.sum(1)[:16] < 0.01).all()  # the sink absorbed nearly everything there


def test_sink_layer_matches_numpy():
    cfg = _cfg()
    hidden = 24
    layer = Moe(hidden, cfg, load_ops("xla"), dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = np.random.default_rng(1).standard_normal((2, 5, hidden)).astype(np.float32)
    got = np.asarray(layer(jnp.asarray(x)))

    def silu(v):
        return v / (1 + np.exp(-v))

    def expert(v, gate, up, down):  # down(silu(gate v) * up v)
        return (silu(v @ gate) * (v @ up)) @ down

    w = {name: np.asarray(getattr(layer, name)[...], np.float64) for name in
         ("router", "up", "gate", "down", "sink_up", "sink_gate", "sink_down")}  # fmt: skip
    flat = x.reshape(-1, hidden).astype(np.float64)
    want = np.zeros_like(flat)
    for m, v in enumerate(flat):
        p = _softmax(v @ w["router"])
        for j in np.argsort(-p[:E])[:K]:
            want[m] += p[j] * expert(v, w["gate"][j], w["up"][j], w["down"][j])
        for s in range(S):
            want[m] += p[E + s] * expert(v, w["sink_gate"][s], w["sink_up"][s], w["sink_down"][s])
    atol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got.reshape(-1, hidden), want, rtol=0, atol=atol)


def test_sink_needs_shared_experts_and_other_routers_one_at_most():
    with pytest.raises(ConfigError, match="sink needs shared experts"):
        _cfg(shared_intermediate_size=0)
    with pytest.raises(ConfigError, match="at most one shared expert"):
        MoeConfig(num_experts=4, top_k=2, intermediate_size=8, num_shared_experts=2)


def test_layer_output_is_finite_under_jit_in_bfloat16():
    layer = Moe(16, _cfg(), load_ops("xla"), dtype=jnp.bfloat16, rngs=nnx.Rngs(4))
    x = jax.random.normal(jax.random.key(5), (7, 16), jnp.bfloat16)
    out = nnx.jit(lambda m, v: m(v))(layer, x)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
