"""Causal GQA attention over a per-row contiguous KV cache with torch's SDPA."""

from __future__ import annotations

import jax
import torch
import torch.nn.functional as F

from backends.protocol import register
from backends.torch.bridge import call


@register("cached_attention", "torch")
def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_positions: jax.Array,
    kv_lengths: jax.Array,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    def fn(qt, kt, vt, pos, kv_len):
        s = kt.shape[1]
        key_pos = torch.arange(s, device=qt.device)[None, None, :]  # [1, 1, S]
        qp = pos.long()[:, :, None]  # [B, T, 1]
        visible = (key_pos <= qp) & (key_pos < kv_len.long()[:, None, None])
        if sliding_window is not None:
            visible &= qp - key_pos < sliding_window
        # A query with no visible key (padding) attends uniformly over the whole cache, as the
        # reference does (all logits zero): a zero query with every key unmasked.
        empty = ~visible.any(-1)  # [B, T]
        visible = visible | empty[:, :, None]
        q32 = torch.where(empty[:, :, None, None], 0.0, qt.float())
        out = F.scaled_dot_product_attention(
            q32.transpose(1, 2),  # [B, N, T, H]
            kt.float().transpose(1, 2),  # [B, K, S, H]
            vt.float().transpose(1, 2),
            attn_mask=visible[:, None],  # [B, 1, T, S]
            scale=scale,
            enable_gqa=True,  # query head h reads kv head h // (N / K)
        )
        return out.transpose(1, 2).to(qt.dtype)

    return call(
        fn, jax.ShapeDtypeStruct(q.shape, q.dtype), q, k_cache, v_cache, q_positions, kv_lengths
    )
