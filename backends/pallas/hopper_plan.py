"""Planning for the Hopper prefill attention kernel (`attention_hopper`), in XLA, before it
runs: which inputs it takes, its key block, and each program's loop bounds (the blocks its
rows see whole, the far and mid blocks of the relative bias, each block's bucket range)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK_Q = 64  # rows per compute warpgroup (one wgmma M tile); a program has two


def plan_loops(
    pos: jax.Array,
    kv_len: jax.Array,
    tiles: int,
    block_k: int,
    n_blocks: int,
    starts: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:
    """Loop bounds, in key blocks, per (row b, tile): `[lo, hi, whole_0, whole_1, far_0, far_1,
    mid_0, mid_1]` int32: the blocks any row of the tile may see, and per compute warpgroup
    the end of the blocks all its rows see whole, of the far blocks (every distance in the last
    bucket) and of the mid blocks (at most two buckets each). And, with a relative bias, each
    block's bucket range per warpgroup, `bucket(d_min) | bucket(d_max) << 8` ([B, tiles, 2,
    blocks])."""
    p = pos.reshape(pos.shape[0], tiles, 2, BLOCK_Q)
    p_min, p_max = p.min(-1), p.max(-1)  # [B, tiles, 2]
    kv = kv_len[:, None]
    hi_key = jnp.minimum(kv, p_max.max(-1) + 1)
    hi = jnp.maximum((hi_key + block_k - 1) // block_k, 0)
    lo = jnp.zeros_like(hi)
    whole = jnp.clip(jnp.minimum(p_min + 1, kv[..., None]) // block_k, 0, hi[..., None])
    if not starts:
        far = mid = jnp.zeros_like(whole)
        lut = jnp.zeros((1, 1, 1, 1), jnp.int32)
    else:
        bounds = jnp.asarray(starts, jnp.int32)
        far = (p_min - starts[-1] + 1) // block_k
        widths = jnp.asarray([b - a for a, b in zip(starts, starts[1:], strict=False)])
        span = block_k - 1 + p_max - p_min  # distances one block spans, per warpgroup
        ids = jnp.arange(1, len(starts), dtype=jnp.int32)
        b_mid = jnp.max(jnp.where(widths < span[..., None], ids, 0), axis=-1)
        mid = (p_min - bounds[b_mid] + 1) // block_k
        start = jnp.arange(n_blocks, dtype=jnp.int32) * block_k
        d_min = p_min[..., None] - (start + block_k - 1)  # [B, tiles, 2, blocks]
        d_max = p_max[..., None] - start

        def bucket(d):
            return jnp.searchsorted(bounds, jnp.maximum(d, 0), side="right").astype(jnp.int32) - 1

        lut = bucket(d_min) | (bucket(d_max) << 8)
    cols = [lo[..., None], hi[..., None], whole, far, mid]
    return jnp.concatenate(cols, axis=-1).astype(jnp.int32), lut


def default_block_k(head_dim: int) -> int:
    """Keys per step: 128 up to d 128 (541 vs 463 TFLOP/s at 8k on an H200, BENCHMARKS.md);
    64 above, where two stages of 128 keys do not fit in shared memory."""
    return 128 if head_dim <= 128 else 64


def supported(
    q: jax.Array, k_pages: jax.Array, sliding_window: int | None, block_k: int | None = None
) -> str | None:
    """Why this kernel does not apply to these inputs (None when it does)."""
    if sliding_window is not None:
        return "sliding windows are not supported"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        return f"needs bf16 or f16 q and pages of the same dtype, got {q.dtype}, {k_pages.dtype}"
    page, hd = k_pages.shape[-2], q.shape[-1]
    block_k = default_block_k(hd) if block_k is None else block_k
    if hd % 64 or hd > 256:
        return f"head dim must be a multiple of 64 up to 256, got {hd}"
    if block_k > 64 and hd > 128:
        return f"blocks of {block_k} keys at head dim {hd} overflow shared memory (use 64)"
    if block_k % page or page % 8:
        return f"page size must divide the key block ({block_k}) and be a multiple of 8: {page}"
    return None
