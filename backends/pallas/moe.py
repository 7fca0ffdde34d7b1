"""Grouped (ragged) matmul for mixture-of-experts layers as a Pallas kernel (bf16/f32 weights,
NVFP4 and FP8 experts).

Rows of x [M, Din] are sorted by expert: expert e owns rows [start_e, end_e), with
end = cumsum(group_sizes) and start = end - group_sizes; then
  out[r, :] = x[r, :] @ w[e(r)]        (zero for rows past sum(group_sizes), as ragged_dot)

The wrapper computes each row's expert `e(r)` (a searchsorted of the row index in `end`, E for
rows owned by no expert) and, per row tile of TM rows, the first and last expert it touches:
e(first row) and e(last row), clipped to E - 1. Grid (row tile, output column tile of TN); each
program loops over its experts (fori_loop with those bounds, so a tile visits only the experts
whose rows it holds, and experts with no rows are skipped or masked to nothing) and, per
expert, over Din in steps of TK:
  acc += where(e(row) == e, x[rows, k:k+TK], 0) @ w[e, k:k+TK, cols]
float32 accumulation (no TF32 for float32 inputs). The total work is about (M / TM + E)
tile matmuls per column tile: linear in M.

Triton on GPU: every load/store must be a power-of-two tile and tl.dot wants every dim >= 16,
so TM, TN, TK are powers of two >= 16, and the wrapper pads M, Din and Dout to whole tiles
(padded rows belong to no expert; padded Din columns are zero in x and w).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends import fp8, nvfp4
from backends.pallas._common import (
    dot,
    e4m3_value,
    interpret,
    next_pow2,
    pad_axis,
    round_up,
    triton_params,
)
from backends.protocol import register
from backends.xla.fp8 import check_scales

F32 = jnp.float32
MIN_BLOCK = 16  # tl.dot: every dim >= 16
MAX_BLOCK_M = 32
MAX_BLOCK_N = 64
MAX_BLOCK_K = 64


def _block(n: int, cap: int) -> int:
    return min(max(next_pow2(n), MIN_BLOCK), cap)


def _row_experts(group_sizes: jax.Array, mp: int, tm: int, n_exp: int):
    """Expert of each (padded) row (E for rows past sum(group_sizes), which no expert owns) and
    each row tile's first and last expert, clipped to E - 1."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_expert = jnp.searchsorted(ends, jnp.arange(mp, dtype=jnp.int32), side="right")
    tiles = row_expert.astype(jnp.int32).reshape(mp // tm, tm)
    first = jnp.minimum(tiles[:, 0], n_exp - 1)
    last = jnp.minimum(tiles[:, -1], n_exp - 1)
    return tiles.reshape(mp), first, last


def _gmm_kernel(first_ref, last_ref, eid_ref, x_ref, w_ref, o_ref, *, n_k, tk):
    row_expert = eid_ref[...]  # [TM]
    acc0 = jnp.zeros(o_ref.shape, F32)

    def expert(e, acc):
        mine = (row_expert == e)[:, None]

        def k_step(k, acc):
            cols = pl.ds(pl.multiple_of(k * tk, tk), tk)
            xk = x_ref[:, cols]  # [TM, TK]
            xk = jnp.where(mine, xk, jnp.zeros_like(xk))
            wk = w_ref[e, cols, :]  # [TK, TN]
            return acc + dot(xk, wk)

        return jax.lax.fori_loop(0, n_k, k_step, acc)

    acc = jax.lax.fori_loop(first_ref[0], last_ref[0] + 1, expert, acc0)
    o_ref[...] = acc.astype(o_ref.dtype)


def _launch(kernel, name: str, rows: tuple, x: jax.Array, weights: list, tn: int, dtype):
    """The grouped kernel over grid (row tile, column tile of `tn`): each program gets its row
    tile's first and last expert and row experts (`rows`, from `_row_experts`), its rows of
    `x` [Mp, K] whole along K, and every expert's column tile of each 3-D array of `weights`
    (columns last, padded to whole tiles) or the whole of each 1-D one (per-expert scales).
    Returns [Mp, Np] in `dtype`."""
    row_expert, first, last = rows
    mp, tm = x.shape[0], x.shape[0] // first.shape[0]
    np_ = next(w.shape[-1] for w in weights if w.ndim == 3)
    tile = lambda w: pl.BlockSpec((*w.shape[:2], tn), lambda i, j: (0, 0, j))  # noqa: E731
    whole = lambda w: pl.BlockSpec(w.shape, lambda i, j: (0,))  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), dtype),
        grid=(mp // tm, np_ // tn),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((tm,), lambda i, j: (i,)),
            pl.BlockSpec((tm, x.shape[1]), lambda i, j: (i, 0)),
            *(tile(w) if w.ndim == 3 else whole(w) for w in weights),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        interpret=interpret(),
        compiler_params=triton_params(),
        name=name,
    )(first, last, row_expert, x, *weights)


@register("grouped_matmul", "pallas")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    m, din = x.shape
    n_exp, _, dout = w.shape
    dtype = jnp.result_type(x.dtype, w.dtype)
    if m == 0 or dout == 0 or n_exp == 0:
        return jnp.zeros((m, dout), dtype)
    tm, tn, tk = _block(m, MAX_BLOCK_M), _block(dout, MAX_BLOCK_N), _block(din, MAX_BLOCK_K)
    mp, np_, kp = round_up(m, tm), round_up(dout, tn), round_up(max(din, 1), tk)
    rows = _row_experts(group_sizes, mp, tm, n_exp)
    xs = pad_axis(pad_axis(x.astype(dtype), 0, mp), 1, kp)
    ws = pad_axis(pad_axis(w.astype(dtype), 1, kp), 2, np_)
    kernel = functools.partial(_gmm_kernel, n_k=kp // tk, tk=tk)
    return _launch(kernel, "grouped_matmul", rows, xs, [ws], tn, dtype)[:m, :dout]


def _nvfp4_kernel(first_ref, last_ref, eid_ref, x_ref, c_ref, s_ref, t_ref, o_ref, *, n_k):
    """Like `_gmm_kernel`, over 32-row K blocks of NVFP4 weights: each block's two nibble
    planes are decoded to [16, TN] tiles, scaled (`(e2m1 * scale) * tensor_scale`, float32,
    then x's dtype, as the reference dequantises) and multiplied with their 16 columns of x."""
    row_expert = eid_ref[...]  # [TM]
    half = nvfp4.BLOCK // 2

    def expert(e, acc):
        mine = (row_expert == e)[:, None]
        tensor_scale = t_ref[pl.ds(e, 1)].reshape(1, 1)

        def k_step(j, acc):
            packed = c_ref[e, pl.ds(pl.multiple_of(j * half, half), half), :]  # [16, TN]
            for plane, code in enumerate((packed & 15, packed >> 4)):
                scale = e4m3_value(s_ref[e, pl.ds(2 * j + plane, 1), :])  # [1, TN]
                w = (nvfp4.e2m1_value(code) * scale * tensor_scale).astype(x_ref.dtype)
                start = pl.multiple_of(j * nvfp4.BLOCK + plane * half, half)
                xk = x_ref[:, pl.ds(start, half)]  # [TM, 16]
                acc = acc + dot(jnp.where(mine, xk, jnp.zeros_like(xk)), w)
            return acc

        return jax.lax.fori_loop(0, n_k, k_step, acc)

    acc = jax.lax.fori_loop(first_ref[0], last_ref[0] + 1, expert, jnp.zeros(o_ref.shape, F32))
    o_ref[...] = acc.astype(o_ref.dtype)


@register("nvfp4_grouped_matmul", "pallas")
def nvfp4_grouped_matmul(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    tensor_scale: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    m, k = x.shape
    n_exp, _, dout = codes.shape
    if k % nvfp4.BLOCK:
        raise ValueError(f"NVFP4 needs K to be a multiple of {nvfp4.BLOCK}, got {k}")
    if m == 0 or dout == 0 or n_exp == 0:
        return jnp.zeros((m, dout), x.dtype)
    tm, tn = _block(m, MAX_BLOCK_M), _block(dout, MAX_BLOCK_N)
    mp, np_ = round_up(m, tm), round_up(dout, tn)
    rows = _row_experts(group_sizes, mp, tm, n_exp)
    scale_bits = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    weights = [pad_axis(codes, 2, np_), pad_axis(scale_bits, 2, np_), tensor_scale.astype(F32)]
    kernel = functools.partial(_nvfp4_kernel, n_k=k // nvfp4.BLOCK)
    out = _launch(kernel, "nvfp4_grouped_matmul", rows, pad_axis(x, 0, mp), weights, tn, x.dtype)
    return out[:m, :dout]


def _fp8_kernel(first_ref, last_ref, eid_ref, x_ref, w_ref, s_ref, o_ref, *, n_k, tk):
    """Like `_gmm_kernel` over e4m3 weights (loaded as bytes, decoded exactly to x's dtype):
    each expert's sum times its weight scale, as the reference scales after the product."""
    row_expert = eid_ref[...]  # [TM]

    def expert(e, acc):
        mine = (row_expert == e)[:, None]

        def k_step(k, part):
            cols = pl.ds(pl.multiple_of(k * tk, tk), tk)
            xk = x_ref[:, cols]  # [TM, TK]
            wk = e4m3_value(w_ref[e, cols, :]).astype(x_ref.dtype)  # [TK, TN]
            return part + dot(jnp.where(mine, xk, jnp.zeros_like(xk)), wk)

        part = jax.lax.fori_loop(0, n_k, k_step, jnp.zeros(o_ref.shape, F32))
        return acc + part * s_ref[pl.ds(e, 1)].reshape(1, 1)

    acc = jax.lax.fori_loop(first_ref[0], last_ref[0] + 1, expert, jnp.zeros(o_ref.shape, F32))
    o_ref[...] = acc.astype(o_ref.dtype)


@register("fp8_grouped_matmul", "pallas")
def fp8_grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    x_scale: jax.Array | None,
    group_sizes: jax.Array,
) -> jax.Array:
    """The grouped matmul over e4m3 experts read at one byte a weight; each row's input first
    rounded through e4m3 under its expert's input scale (in XLA)."""
    check_scales(w, w_scale, x_scale, 1)
    m, din = x.shape
    n_exp, _, dout = w.shape
    if m == 0 or dout == 0 or n_exp == 0:
        return jnp.zeros((m, dout), x.dtype)
    tm, tn, tk = _block(m, MAX_BLOCK_M), _block(dout, MAX_BLOCK_N), _block(din, MAX_BLOCK_K)
    mp, np_, kp = round_up(m, tm), round_up(dout, tn), round_up(din, tk)
    rows = _row_experts(group_sizes, mp, tm, n_exp)
    xs = pad_axis(x, 0, mp)
    if x_scale is not None:
        owner = jnp.minimum(rows[0], n_exp - 1)
        xs = fp8.fake_quantize(xs, x_scale.astype(F32)[owner][:, None])
    bits = jax.lax.bitcast_convert_type(w, jnp.uint8)
    weights = [pad_axis(pad_axis(bits, 1, kp), 2, np_), w_scale.astype(F32)]
    kernel = functools.partial(_fp8_kernel, n_k=kp // tk, tk=tk)
    out = _launch(kernel, "fp8_grouped_matmul", rows, pad_axis(xs, 1, kp), weights, tn, x.dtype)
    return out[:m, :dout]
