"""Mamba2 state-space duality (SSD): chunked scan for prefill and the one-token state update.

The chunked scan splits T into chunks of length L. With `l_t = dt_t * a` and its inclusive
cumulative sum `cs` inside each chunk:
  intra-chunk:  `y_i += sum_{j<=i} (c_i . b_j) exp(cs_i - cs_j) dt_j x_j`
  chunk state:  `S_c = sum_j exp(cs_last - cs_j) dt_j (x_j outer b_j)`
  carry:        `h_{c+1} = exp(cs_last) h_c + S_c`, with `h_0` the initial state
  inter-chunk:  `y_i += exp(cs_i) (h_c . c_i)`
  skip:         `y_i += d x_i`
All of it in float32; the result equals the token-by-token recurrence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from backends.protocol import register


def _heads_from_groups(m: jax.Array, num_heads: int) -> jax.Array:
    """[..., G, Ns] -> [..., Hs, Ns]: head h reads group h // (Hs / G)."""
    return jnp.repeat(m, num_heads // m.shape[-2], axis=-2)


@register("mamba2_scan", "xla")
def mamba2_scan(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    initial_state: jax.Array,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    bsz, t, nh, p = x.shape
    length = min(chunk_size, t)
    pad = (-t) % length
    f32 = jnp.float32
    xs, dts = x.astype(f32), dt.astype(f32)
    bs = _heads_from_groups(b.astype(f32), nh)
    cs_ = _heads_from_groups(c.astype(f32), nh)
    if pad:
        # Padding with dt = 0 and x = 0 leaves the state untouched.
        xs, dts, bs, cs_ = (
            jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)) for v in (xs, dts, bs, cs_)
        )
    nc = (t + pad) // length

    def chunks(v: jax.Array) -> jax.Array:
        return v.reshape(bsz, nc, length, *v.shape[2:])

    xs, dts, bs, cs_ = chunks(xs), chunks(dts), chunks(bs), chunks(cs_)
    la = dts * a.astype(f32)  # [B, nc, L, Hs]
    cum = jnp.cumsum(la, axis=2)
    # Intra-chunk (the "diagonal blocks"): decay[i, j] = exp(cum_i - cum_j) for j <= i.
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B, nc, i, j, Hs]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None, :, :, None]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, seg, 0.0)), 0.0)
    scores = jnp.einsum("bzihn,bzjhn->bzijh", cs_, bs) * decay
    y = jnp.einsum("bzijh,bzjh,bzjhp->bzihp", scores, dts, xs)
    # Per-chunk states from the chunk's own tokens.
    to_end = jnp.exp(cum[:, :, -1:, :] - cum)  # [B, nc, L, Hs]
    chunk_states = jnp.einsum("bzjh,bzjh,bzjhp,bzjhn->bzhpn", to_end, dts, xs, bs)
    chunk_decay = jnp.exp(cum[:, :, -1, :])  # [B, nc, Hs]

    def carry(h: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        state_c, decay_c = inputs
        return decay_c[:, :, None, None] * h + state_c, h

    final, starts = jax.lax.scan(
        carry,
        initial_state.astype(f32),
        (jnp.moveaxis(chunk_states, 1, 0), jnp.moveaxis(chunk_decay, 1, 0)),
    )
    starts = jnp.moveaxis(starts, 0, 1)  # [B, nc, Hs, P, Ns]: state entering each chunk
    y = y + jnp.einsum("bzih,bzhpn,bzihn->bzihp", jnp.exp(cum), starts, cs_)
    y = y + d.astype(f32)[None, None, None, :, None] * xs
    y = y.reshape(bsz, nc * length, nh, p)[:, :t]
    return y.astype(x.dtype), final


@register("mamba2_step", "xla")
def mamba2_step(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    f32 = jnp.float32
    nh = x.shape[1]
    x32, dt32 = x.astype(f32), dt.astype(f32)
    bh = _heads_from_groups(b.astype(f32), nh)  # [B, Hs, Ns]
    ch = _heads_from_groups(c.astype(f32), nh)
    decay = jnp.exp(dt32 * a.astype(f32))  # [B, Hs]
    new_state = decay[:, :, None, None] * state.astype(f32) + jnp.einsum(
        "bh,bhp,bhn->bhpn", dt32, x32, bh
    )
    y = jnp.einsum("bhpn,bhn->bhp", new_state, ch) + d.astype(f32)[None, :, None] * x32
    return y.astype(x.dtype), new_state
