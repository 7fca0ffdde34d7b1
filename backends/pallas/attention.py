"""Paged GQA attention with a learned relative-position bias, as one Pallas kernel for prefill
chunks and decode tokens alike.

Layout: the N/K query heads that share a kv head are folded into the rows of one matmul. For kv
head k of batch row b, row `m = t * (N/K) + r` of the kernel's query matrix is token t's query
head `k * (N/K) + r`, at position `pos[m] = q_positions[b, t]`. A decode step (T = 1) thus
reads each kv head's pages once for all its query heads; a prefill chunk tiles its T * N/K rows.

Grid: (batch row, kv head, row tile of `block_m` rows). Each program walks the row's key blocks
of `block_k` tokens (`block_k / page` pages gathered through the block table) from the first
key any of its rows may see (`min(pos) - window + 1`) to the last (`min(kv_len, max(pos) + 1)`),
with the online softmax of flash attention (without a window, the blocks whose keys every row
sees, `j < min(min(pos) + 1, kv_len)`, skip the masks):
  `l = scale * q k^T + bias`,  `m' = max(m, rowmax l)`,
  `acc' = exp(m - m') acc + exp(l - m') v`,  `s' = exp(m - m') s + rowsum exp(l - m')`,
and writes `acc / s` (zeros for rows with no visible key). Keys outside `[lo, kv_len)` are
zeroed before the matmuls (they may hold other layers' bytes, even NaNs); the visibility mask
zeroes their probabilities.

Relative bias ("sheared": never materialised): `bias[m, j] = rel_q[m] . table[bucket(pos[m] -
j)]`. Each program first computes every row's bias at every bucket, `rel_q table^T`
([block_m, nb], one small matmul). Blocks all of whose distances fall in the last bucket
(`pos - j >= its start`, most of a long prefill) run in a loop of their own that adds that
bucket's column as a per-row constant. Elsewhere the distances of a tile span `[dmin, dmax]`,
so only the buckets `bucket(dmin)` to `bucket(dmax)` occur: a tile spanning one bucket adds its
column (no masks); tiles near the diagonal loop over their buckets, adding each column where the
distance falls in that bucket's range. No [T, S] array is ever formed.

K and V come as two arrays or as the region's own joint view [Pg, 2, K, page, H], whose two
halves two BlockSpecs index (K at index 0 of axis 1, V at 1): no slice copies the cache (a
slice of each half fed to the kernel is materialised whole, every layer, every step).

Triton on GPU needs power-of-two tiles: pages (the kernel block) must be a power of two, and the
wrapper pads the head dim (copying the cache when it is not a power of two, e.g. 80) and R.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends.pallas._common import dot, interpret, next_pow2, pad_axis, round_up, triton_params
from backends.pallas.attention_hopper import prefill_attention_hopper
from backends.pallas.hopper_plan import supported as hopper_supported
from backends.protocol import BackendError, RelativeBias, is_joint_kv, register

F32 = jnp.float32
NEG = -1e30  # masked logits: finite, so that exp(m - m') never sees inf - inf
FAR = 2**30  # bucket start past every distance (padding buckets)


def _kernel(
    table_ref,
    kv_len_ref,
    pos_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    pages,
    scale,
    window,
    rel,
    split,
    far,
    splits,
):
    lse_ref = None
    if splits > 1:
        *refs, lse_ref = refs
    if rel:
        rq_ref, emb_ref, bound_ref, widths_ref, o_ref = refs
        far_start, far_bucket = far
    else:
        (o_ref,) = refs
    page = k_ref.shape[1]
    block_k = pages * page
    q = q_ref[...]
    pos = pos_ref[...]  # [block_m]
    kv_len = kv_len_ref[0]
    p_min, p_max = jnp.min(pos), jnp.max(pos)
    hi = jnp.minimum(kv_len, p_max + 1)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(p_min - window + 1, 0)
    first, last = lo // block_k, (hi + block_k - 1) // block_k
    if splits > 1:  # split-KV: this program takes its share of the key blocks
        per = (last - first + splits - 1) // splits
        own_lo = jnp.minimum(first + pl.program_id(3) * per, last)
        own_hi = jnp.minimum(own_lo + per, last)
    else:
        own_lo, own_hi = first, last

    def mine(b):  # a loop bound clipped to this program's blocks
        return jnp.clip(b, own_lo, own_hi)

    if rel:
        bounds = bound_ref[...]  # [nb] bucket starts, padded with FAR
        # every row's bias at every bucket, once per program: [block_m, nb]
        rq, emb = rq_ref[...], emb_ref[...]
        common = jnp.promote_types(rq.dtype, emb.dtype)
        columns = dot(rq.astype(common), emb.astype(common), 1, 1)
        bucket_ids = jnp.arange(bounds.shape[0], dtype=jnp.int32)

    def column(b):  # [block_m, 1]: every row's bias at bucket b
        return jnp.sum(jnp.where(bucket_ids[None, :] == b, columns, 0.0), axis=1)[:, None]

    def bucket_of(d):  # scalar distance -> its bucket
        return jnp.sum((bounds <= d).astype(jnp.int32)) - 1

    def near_bias(start, dist):  # any tile: loop over the buckets its distances span
        b_lo = bucket_of(jnp.maximum(p_min - (start + block_k - 1), 0))
        b_hi = bucket_of(jnp.maximum(p_max - start, 0))

        def add(b, bias):
            lo_d = bound_ref[pl.ds(b, 1)].reshape(1, 1)
            hi_d = bound_ref[pl.ds(b + 1, 1)].reshape(1, 1)
            inside = (dist >= lo_d) & (dist < hi_d)
            return bias + jnp.where(inside, column(b), 0.0)

        return jax.lax.fori_loop(b_lo, b_hi + 1, add, jnp.zeros(dist.shape, F32))

    def mid_bias(start, dist):  # a tile whose distances span at most two buckets: a select
        b_lo = bucket_of(jnp.maximum(p_min - (start + block_k - 1), 0))
        edge = bound_ref[pl.ds(b_lo + 1, 1)].reshape(1, 1)
        return jnp.where(dist >= edge, column(b_lo + 1), column(b_lo))

    def body(i, carry, masked=True, bias=None):
        acc, m_i, s_i = carry
        if pages == 1:  # one page per key block: a plain (pipelinable) block load
            page_id = table_ref[i]
            k, v = k_ref[page_id], v_ref[page_id]
        else:
            ids = table_ref[pl.ds(i * pages, pages)]
            k = k_ref[ids].reshape(block_k, -1)
            v = v_ref[ids].reshape(block_k, -1)
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # e4m3 pages: widened before any select
        start = i * block_k
        key = start + jnp.arange(block_k, dtype=jnp.int32)
        dist = pos[:, None] - key[None, :]
        if masked:
            live = (key >= lo) & (key < kv_len)
            k = jnp.where(live[:, None], k, 0)
            v = jnp.where(live[:, None], v, 0)
        logits = dot(q, k, 1, 1) * scale  # [block_m, block_k]
        if bias is not None:  # a per-row constant, or a function of the tile's distances
            logits += bias if isinstance(bias, jax.Array) else bias(start, dist)
        if masked:
            visible = live[None, :] & (dist >= 0)
            if window is not None:
                visible &= dist < window
            logits = jnp.where(visible, logits, NEG)
        m_new = jnp.maximum(m_i, jnp.max(logits, axis=1))
        corr = jnp.exp(m_i - m_new)
        p = jnp.exp(logits - m_new[:, None])
        if masked:
            p = jnp.where(visible, p, 0.0)
        acc = corr[:, None] * acc + dot(p.astype(q.dtype), v)
        return acc, m_new, corr * s_i + jnp.sum(p, axis=1)

    rows, width = q.shape
    init = (jnp.zeros((rows, width), F32), jnp.full((rows,), NEG, F32), jnp.zeros((rows,), F32))
    if split:  # blocks every row sees whole (keys <= min(pos), < kv_len) skip the masks
        inner = jnp.clip(jnp.minimum(p_min + 1, kv_len) // block_k, first, last)
        unmasked = functools.partial(body, masked=False)
        if rel:
            # Far blocks (every distance in the last bucket): a per-row constant bias.
            far_end = jnp.clip((p_min - far_start + 1) // block_k, first, inner)
            far_body = functools.partial(unmasked, bias=column(far_bucket))
            init = jax.lax.fori_loop(mine(first), mine(far_end), far_body, init)
            # Mid blocks: distances from `d_mid` on, where every bucket is at least as wide as
            # a tile's distance span, so a tile spans at most two buckets.
            span = block_k - 1 + p_max - p_min
            b_mid = jnp.max(jnp.where(widths_ref[...] < span, bucket_ids + 1, 0))
            d_mid = bound_ref[pl.ds(b_mid, 1)][0]
            mid_end = jnp.clip((p_min - d_mid + 1) // block_k, far_end, inner)
            mid_body = functools.partial(unmasked, bias=mid_bias)
            init = jax.lax.fori_loop(mine(far_end), mine(mid_end), mid_body, init)
            first, unmasked = mid_end, functools.partial(unmasked, bias=near_bias)
        init = jax.lax.fori_loop(mine(first), mine(inner), unmasked, init)
        first = inner
    masked = functools.partial(body, bias=near_bias if rel else None)
    acc, m, s = jax.lax.fori_loop(mine(first), mine(last), masked, init)
    out = jnp.where(s[:, None] > 0, acc / jnp.where(s > 0, s, 1.0)[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype)
    if lse_ref is not None:  # log-sum-exp of this split's logits (NEG: it saw no key)
        lse_ref[...] = jnp.where(s > 0, m + jnp.log(jnp.where(s > 0, s, 1.0)), NEG)


def paged_attention_tiled(
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
    *,
    block_m: int = 64,
    block_k: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int = 1,
) -> jax.Array:
    """`paged_attention` with explicit tiles: `block_m` query rows (tokens x heads of a kv
    group) and `block_k` keys per step (rounded to whole pages); the benchmark sweeps them.
    `splits` > 1: split-KV, each (row, kv head, row tile) program's key blocks shared among
    that many programs, whose normalised outputs are merged by their log-sum-exps."""
    bsz, t, nq, hd = q.shape
    joint = is_joint_kv(k_pages, v_pages)  # both halves read from the one array
    nkv, page = k_pages.shape[-3], k_pages.shape[-2]
    ratio = nq // nkv
    interp = interpret()
    if not interp and page & (page - 1):
        raise BackendError(f"pallas paged_attention needs a power-of-two page, got {page}")
    rows = t * ratio
    bm = min(block_m, next_pow2(rows))
    if not interp:
        bm = max(bm, 16)  # tl.dot wants every dim >= 16
    mp, hp = round_up(rows, bm), next_pow2(hd)
    pages = max(1, block_k // page)
    nblk = next_pow2(round_up(block_table.shape[1], pages))
    table = pad_axis(block_table.astype(jnp.int32), 1, nblk)  # padding: page 0, never read

    def fold(x: jax.Array, width: int) -> jax.Array:  # [B, T, N, X] -> [B, K, Mp, width]
        x = x.reshape(bsz, t, nkv, ratio, -1).transpose(0, 2, 1, 3, 4).reshape(bsz, nkv, rows, -1)
        return pad_axis(pad_axis(x, 2, mp), 3, width)

    pos = jnp.repeat(q_positions.astype(jnp.int32), ratio, axis=1)
    pos = jnp.pad(pos, ((0, 0), (0, mp - rows)), mode="edge")
    row_spec = lambda w: pl.BlockSpec((None, None, bm, w), lambda b, h, i, *_: (b, h, i, 0))  # noqa: E731
    if joint:
        kv_p = pad_axis(k_pages, 4, hp)
        block = (kv_p.shape[0], None, None, page, hp)
        page_specs = [
            pl.BlockSpec(block, lambda b, h, i, *_, half=half: (0, half, h, 0, 0))
            for half in (0, 1)
        ]
        pages_args = [kv_p, kv_p]
    else:
        k_p, v_p = pad_axis(k_pages, 3, hp), pad_axis(v_pages, 3, hp)
        spec = pl.BlockSpec((k_p.shape[0], None, page, hp), lambda b, h, i, *_: (0, h, 0, 0))
        page_specs, pages_args = [spec, spec], [k_p, v_p]
    in_specs = [
        pl.BlockSpec((None, nblk), lambda b, h, i, *_: (b, 0)),
        pl.BlockSpec((1,), lambda b, h, i, *_: (b,)),
        pl.BlockSpec((None, bm), lambda b, h, i, *_: (b, i)),
        row_spec(hp),
        *page_specs,
    ]
    args = [table, kv_lengths.astype(jnp.int32), pos, fold(q, hp), *pages_args]
    rel = rel_bias is not None
    if rel:
        rp = next_pow2(rel_q.shape[-1])
        starts = rel_bias.boundaries()
        nb = max(16, next_pow2(len(starts) + 1))  # tl.dot wants every dim >= 16
        bounds = jnp.asarray(list(starts) + [FAR] * (nb - len(starts)), jnp.int32)
        widths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        widths = jnp.asarray(widths + [FAR] * (nb - len(widths)), jnp.int32)  # last: unbounded
        emb = pad_axis(pad_axis(rel_table, 1, rp), 0, nb)
        in_specs += [
            row_spec(rp),
            pl.BlockSpec((nb, rp), lambda b, h, i, *_: (0, 0)),
            pl.BlockSpec((nb,), lambda b, h, i, *_: (0,)),
            pl.BlockSpec((nb,), lambda b, h, i, *_: (0,)),
        ]
        args += [fold(rel_q, rp), emb, bounds, widths]
    # Unmasked blocks first: +50% for prefill on an H200, but 1.5x slower for decode rows over
    # gathered pages (BENCHMARKS.md), which keep the one masked loop.
    split = sliding_window is None and (pages == 1 or t > 1)
    far = (starts[-1], len(starts) - 1) if rel else None  # the last bucket: start, index
    kernel = functools.partial(
        _kernel,
        pages=pages,
        scale=scale,
        window=sliding_window,
        rel=rel,
        split=split,
        far=far,
        splits=splits,
    )
    grid = (bsz, nkv, mp // bm)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((bsz, nkv, mp, hp), q.dtype)
        out_specs = row_spec(hp)
    else:  # per split: its normalised output (float32) and its log-sum-exp
        grid += (splits,)
        out_shape = (
            jax.ShapeDtypeStruct((bsz, nkv, splits, mp, hp), F32),
            jax.ShapeDtypeStruct((bsz, nkv, splits, mp), F32),
        )
        out_specs = (
            pl.BlockSpec((None, None, None, bm, hp), lambda b, h, i, s: (b, h, s, i, 0)),
            pl.BlockSpec((None, None, None, bm), lambda b, h, i, s: (b, h, s, i)),
        )
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interp,
        compiler_params=triton_params(num_warps, num_stages),
        name="paged_attention",
    )(*args)
    if splits > 1:  # out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s
        parts, lse = out
        weight = jnp.exp(lse - jnp.max(lse, axis=2, keepdims=True))
        weight = weight / jnp.sum(weight, axis=2, keepdims=True)
        out = jnp.sum(weight[..., None] * parts, axis=2).astype(q.dtype)
    out = out[:, :, :rows, :hd].reshape(bsz, nkv, t, ratio, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(bsz, t, nq, hd)


@register("paged_attention", "pallas")
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
    # Prefill chunks on Hopper: the Mosaic GPU kernel (wgmma, TMA), where it takes the inputs.
    hopper = q.shape[1] >= HOPPER_MIN_TOKENS and hopper_gpu()
    if hopper and hopper_supported(q, k_pages, sliding_window) is None:
        return prefill_attention_hopper(
            q, k_pages, v_pages, block_table, q_positions, kv_lengths, scale,
            sliding_window, rel_q, rel_table, rel_bias,
        )  # fmt: skip
    # Decode steps over small pages were fastest with 32-key blocks on an H200 (BENCHMARKS.md).
    decode = q.shape[1] == 1
    block_k = 32 if decode and k_pages.shape[-2] < 32 else 64
    return paged_attention_tiled(
        q, k_pages, v_pages, block_table, q_positions, kv_lengths, scale, sliding_window,
        rel_q, rel_table, rel_bias, block_k=block_k,
        splits=decode_splits(q, k_pages, block_table, block_k) if decode else 1,
    )  # fmt: skip


HOPPER_MIN_TOKENS = 64  # shorter chunks (and decode) keep the Triton kernel
ENV_HOPPER = "HYBRIDSERVE_HOPPER_ATTENTION"  # "0": never the Mosaic GPU prefill kernel


@functools.cache
def hopper_gpu() -> bool:
    """Does the default device take the Hopper (sm90) Mosaic GPU prefill kernel? A GPU of
    compute capability 9.x, compiled kernels (not interpret mode), and not switched off with
    `HYBRIDSERVE_HOPPER_ATTENTION=0`."""
    if os.environ.get(ENV_HOPPER, "").strip() == "0" or interpret():
        return False
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "")
    return str(capability).split(".")[0] == "9"


SPLIT_PROGRAMS = 256  # split-KV grows a small decode grid to about this many programs


def decode_splits(q: jax.Array, k_pages: jax.Array, block_table: jax.Array, block_k: int) -> int:
    """Split-KV for a decode step: one program per (row, kv head) walks its whole context
    (batch 1 of an 8-kv-head model: 8 programs on 132 multiprocessors), so the key blocks
    are shared among more programs while the grid is small; at least two blocks each."""
    programs = q.shape[0] * k_pages.shape[-3]
    blocks = block_table.shape[1] * k_pages.shape[-2] // block_k
    return max(1, min(SPLIT_PROGRAMS // programs, blocks // 2))
