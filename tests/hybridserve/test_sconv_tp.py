"""Sconv-aware TP (reduce-scatter, local conv, all-gather) on forced CPU devices equals the
single-device computation `sconv(h @ W)` (float32, 1e-5 of the output scale), and each device
holds 1/tp of the sconv state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.protocol import load_ops
from hybridserve.layers.sconv_tp import projected_sconv
from hybridserve.parallel import make_mesh


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sconv_tp_equals_one_device(tp):
    rng = np.random.default_rng(tp)
    bsz, t, f, d, width = 3, 9, 16, 24, 4
    h = jnp.asarray(rng.standard_normal((bsz, t, f)), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((f, d)) / 4, jnp.float32)
    cw = jnp.asarray(rng.standard_normal((d, width)), jnp.float32)
    cb = jnp.asarray(rng.standard_normal(d), jnp.float32)
    state = jnp.asarray(rng.standard_normal((bsz, d, width - 1)), jnp.float32)
    lengths = jnp.asarray([t, 4, 0], jnp.int32)
    ops = load_ops("xla")
    want_y, want_state = ops.causal_conv1d(h @ w_out, state, cw, cb, lengths, "silu")
    mesh = make_mesh(tp)
    got_y, got_state = jax.jit(
        lambda *a: projected_sconv(*a, ops, mesh, "silu")
    )(h, w_out, cw, cb, state, lengths)  # fmt: skip
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    scale = np.abs(np.asarray(want_y)).max()
    np.testing.assert_allclose(np.asarray(got_y)[valid], np.asarray(want_y)[valid],
                               rtol=0, atol=1e-5 * scale)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=0, atol=1e-5)
    shards = got_state.addressable_shards
    assert len(shards) == tp
    assert all(s.data.nbytes * tp == want_state.nbytes for s in shards)
    assert {s.data.shape for s in shards} == {(bsz, d // tp, width - 1)}


def test_channels_must_split_evenly():
    ops, mesh = load_ops("xla"), make_mesh(4)
    h, w = jnp.ones((1, 2, 8)), jnp.ones((8, 6))
    with pytest.raises(ValueError, match="multiples of tp"):
        projected_sconv(h, w, jnp.ones((6, 4)), None, jnp.ones((1, 6, 3)), jnp.ones(1, int), ops,
                        mesh)  # fmt: skip
