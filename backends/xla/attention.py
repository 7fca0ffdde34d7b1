"""Causal GQA attention over the paged KV cache (sliding window, relative-position bias): the
reference. It gathers each row's pages into a contiguous [B, S, K, H] view and masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from backends.protocol import RelativeBias, register, split_kv

F32 = jnp.float32


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """[Pg, K, page, H] pages and a [B, nblk] table -> [B, nblk * page, K, H]."""
    rows = jnp.swapaxes(pages[block_table], 2, 3)  # [B, nblk, page, K, H]
    return rows.reshape(rows.shape[0], -1, *rows.shape[3:])


def visible_keys(
    q_positions: jax.Array, kv_lengths: jax.Array, s: int, sliding_window: int | None
) -> jax.Array:
    """[B, T, S] bool: key j is visible to the query (causal, cached, inside the window)."""
    key_pos = jnp.arange(s)[None, None, :]
    qp = q_positions[:, :, None]
    visible = (key_pos <= qp) & (key_pos < kv_lengths[:, None, None])
    if sliding_window is not None:
        visible &= qp - key_pos < sliding_window
    return visible


@register("paged_attention", "xla")
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array | None,
    block_table: jax.Array,
    q_positions: jax.Array,
    kv_lengths: jax.Array,
    scale: float,
    sliding_window: int | None,
    rel_q: jax.Array | None = None,
    rel_table: jax.Array | None = None,
    rel_bias: RelativeBias | None = None,
) -> jax.Array:
    k_pages, v_pages = split_kv(k_pages, v_pages)
    bsz, t, nq, hd = q.shape
    k = gather_pages(k_pages, block_table).astype(F32)  # [B, S, K, H]
    v = gather_pages(v_pages, block_table).astype(F32)
    s, nkv = k.shape[1], k.shape[2]
    visible = visible_keys(q_positions, kv_lengths, s, sliding_window)  # [B, T, S]
    # Keys nobody sees may hold any bytes: keep them (and NaN * 0) out of the sums.
    seen = jnp.any(visible, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    k, v = jnp.where(seen, k, 0.0), jnp.where(seen, v, 0.0)
    qg = q.reshape(bsz, t, nkv, nq // nkv, hd).astype(F32)
    logits = jnp.einsum("btkrh,bskh->bkrts", qg, k) * scale
    if rel_bias is not None:
        per_bucket = jnp.einsum("btnd,ed->bnte", rel_q.astype(F32), rel_table.astype(F32))
        dist = q_positions[:, :, None] - jnp.arange(s)[None, None, :]  # [B, T, S]
        bucket = jnp.broadcast_to(rel_bias.bucket(dist)[:, None], (bsz, nq, t, s))
        bias = jnp.take_along_axis(per_bucket, bucket, axis=3)  # [B, N, T, S]
        logits = logits + bias.reshape(bsz, nkv, nq // nkv, t, s)
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    any_key = jnp.any(visible, axis=-1)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    probs = jax.nn.softmax(jnp.where(any_key, logits, 0.0), axis=-1)
    probs = jnp.where(any_key, probs, 0.0)  # no visible key: zeros
    out = jnp.einsum("bkrts,bskh->btkrh", probs, v)
    return out.reshape(bsz, t, nq, hd).astype(q.dtype)
