"""Causal GQA attention over a per-row contiguous KV cache (with an optional sliding window)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from backends.protocol import register


@register("cached_attention", "xla")
def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_positions: jax.Array,
    kv_lengths: jax.Array,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    bsz, t, nq, hd = q.shape
    s, nkv = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(bsz, t, nkv, nq // nkv, hd).astype(jnp.float32)
    logits = jnp.einsum("btkrh,bskh->bkrts", qg, k_cache.astype(jnp.float32)) * scale
    key_pos = jnp.arange(s)[None, None, :]  # [1, 1, S]
    qp = q_positions[:, :, None]  # [B, T, 1]
    visible = (key_pos <= qp) & (key_pos < kv_lengths[:, None, None])
    if sliding_window is not None:
        visible &= qp - key_pos < sliding_window
    logits = jnp.where(visible[:, None, None, :, :], logits, -jnp.inf)
    # Rows with no visible key (padding) would give NaN: keep them finite.
    logits = jnp.where(jnp.any(visible, -1)[:, None, None, :, None], logits, 0.0)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkrts,bskh->btkrh", probs, v_cache.astype(jnp.float32))
    return out.reshape(bsz, t, nq, hd).astype(q.dtype)
