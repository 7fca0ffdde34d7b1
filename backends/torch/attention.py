"""Causal GQA attention over the paged KV cache with torch's SDPA: the pages of each row are
gathered into a contiguous cache, and the mask and relative bias become SDPA's additive mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from backends.protocol import RelativeBias, register, split_kv
from backends.torch.bridge import call


def _gather(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[Pg, K, page, H] and [B, nblk] -> [B, K, nblk * page, H]."""
    rows = pages[table.long()]  # [B, nblk, K, page, H]
    b, nblk, k, page, h = rows.shape
    return rows.permute(0, 2, 1, 3, 4).reshape(b, k, nblk * page, h)


@register("paged_attention", "torch")
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
    bounds = None if rel_bias is None else rel_bias.boundaries()

    def fn(qt, kp, vp, table, pos, kv_len, *rel):
        k, v = _gather(kp, table).float(), _gather(vp, table).float()  # [B, K, S, H]
        s = k.shape[2]
        key_pos = torch.arange(s, device=qt.device)[None, None, :]  # [1, 1, S]
        qp = pos.long()[:, :, None]  # [B, T, 1]
        visible = (key_pos <= qp) & (key_pos < kv_len.long()[:, None, None])
        if sliding_window is not None:
            visible &= qp - key_pos < sliding_window
        seen = visible.any(1)[:, None, :, None]  # [B, 1, S, 1]: unseen keys may be garbage
        k, v = torch.where(seen, k, 0.0), torch.where(seen, v, 0.0)
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=qt.device)[:, None]
        if rel:  # the bucket starts come in as a device array (no host copy: graph-safe)
            rq, tab, edges = rel
            per_bucket = torch.einsum("btnd,ed->bnte", rq.float(), tab.float())
            edges = edges.long()
            bucket = torch.bucketize((qp - key_pos).clamp(min=0), edges, right=True) - 1
            idx = bucket[:, None].expand(-1, per_bucket.shape[1], -1, -1)  # [B, N, T, S]
            mask = torch.gather(per_bucket, 3, idx)
        # A query with no visible key attends to every (zeroed) key; its output is zeroed.
        empty = ~visible.any(-1)  # [B, T]
        mask = mask.masked_fill(~(visible | empty[:, :, None])[:, None], float("-inf"))
        out = F.scaled_dot_product_attention(
            qt.float().transpose(1, 2),  # [B, N, T, H]
            k,
            v,
            attn_mask=mask,  # [B, 1 or N, T, S]
            scale=scale,
            enable_gqa=True,  # query head n reads kv head n // (N / K)
        ).transpose(1, 2)
        return torch.where(empty[:, :, None, None], 0.0, out).to(qt.dtype)

    rel = () if rel_bias is None else (rel_q, rel_table, jnp.asarray(bounds, jnp.int32))
    arrays = (q, k_pages, v_pages, block_table, q_positions, kv_lengths, *rel)
    return call(fn, jax.ShapeDtypeStruct(q.shape, q.dtype), *arrays)
