"""RMSNorm and gated group RMSNorm as Pallas kernels.

Both flatten the leading dims to R rows and use a grid over row tiles of BR rows; statistics are
float32, and the result matches the xla reference step for step:
  rms_norm:       n = x / sqrt(sum(x^2) / D + eps);           out = weight * n.astype(x.dtype)
  gated_rms_norm: g = y * silu(z);  n = g / sqrt(sum(g^2) / S + eps) per group of S channels;
                  out = weight * n.astype(y.dtype)
(the weight multiply happens after the cast back, in the promoted dtype of weight and x).

Both view their inputs as [R, G, S] (rms_norm: one group of S = D) with a grid axis over the G
groups: each program normalises one group of one row tile, so no in-kernel reshape is needed.

Triton on GPU: every load/store must be a power-of-two tile, so the wrapper pads the feature
dim D (or each group's S) to a power of two and R to whole row tiles. Padded columns are zero
(g = 0 * silu(0) = 0 for the gated norm), so they add nothing to the sum of squares, and the
mean divides by the true D (or S). Padded rows and columns are sliced off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends.pallas._common import interpret, next_pow2, pad_axis, round_up, triton_params
from backends.protocol import register

F32 = jnp.float32
MAX_BLOCK_R = 16
MAX_TILE = 16384  # elements of one [BR, D] tile: keeps wide rows (D = 8192) in registers


def _block_rows(rows: int, width: int) -> int:
    """Rows per program: a power of two, at most MAX_BLOCK_R and MAX_TILE // width."""
    return max(1, min(next_pow2(rows), MAX_BLOCK_R, MAX_TILE // width))


def _warps(width: int) -> int:
    return 4 if width <= 2048 else 8


def _normalise(v: jax.Array, size: int, eps: float) -> jax.Array:
    """v [BR, Dp] float32 with zero padded columns; normalised over the true `size` columns."""
    mean_sq = jnp.sum(v * v, axis=1, keepdims=True) / size
    return v * jax.lax.rsqrt(mean_sq + eps)


def _kernel(*refs, size, eps, gated):
    """One row tile of one group: `n = g / sqrt(sum(g^2) / size + eps)`, `g = y` (or
    `y * silu(z)` when gated); `out = w * n.astype(y.dtype)`."""
    y_ref, *gate, w_ref, o_ref = refs
    y = y_ref[...]  # [BR, Sp]
    g = y.astype(F32)
    if gated:
        z = gate[0][...].astype(F32)
        g = g * (z / (1.0 + jnp.exp(-z)))
    normed = _normalise(g, size, eps).astype(y.dtype)
    o_ref[...] = (w_ref[...] * normed).astype(o_ref.dtype)  # w [1, Sp] broadcasts over rows


def _group_norm(
    inputs: tuple[jax.Array, ...], weight: jax.Array, eps: float, group_size: int, name: str
) -> jax.Array:
    """Normalise `inputs[0]` (gated by `inputs[1]` when given) per group of `group_size`
    channels: a grid over (row tile, group) of [R, G, S] views."""
    y = inputs[0]
    *lead, inner = y.shape
    if group_size <= 0 or inner % group_size:
        raise ValueError(f"inner size {inner} is not a multiple of group_size {group_size}")
    groups = inner // group_size
    rows = y.size // inner if inner else 0
    out_dtype = jnp.result_type(weight.dtype, y.dtype)
    if rows == 0 or inner == 0:
        return jnp.zeros(y.shape, out_dtype)
    sp = next_pow2(group_size)
    br = _block_rows(rows, sp)
    rp = round_up(rows, br)

    def grouped(v: jax.Array) -> jax.Array:  # [..., I] -> [Rp, G, Sp]
        return pad_axis(pad_axis(v.reshape(rows, groups, group_size), 0, rp), 2, sp)

    w = pad_axis(weight.reshape(groups, group_size), 1, sp)  # [G, Sp]
    kernel = functools.partial(_kernel, size=group_size, eps=eps, gated=len(inputs) == 2)
    row_spec = pl.BlockSpec((br, None, sp), lambda i, g: (i, g, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rp, groups, sp), out_dtype),
        grid=(rp // br, groups),
        in_specs=[row_spec] * len(inputs) + [pl.BlockSpec((1, sp), lambda i, g: (g, 0))],
        out_specs=row_spec,
        interpret=interpret(),
        compiler_params=triton_params(num_warps=_warps(sp)),
        name=name,
    )(*map(grouped, inputs), w)
    return out[:rows, :, :group_size].reshape(*lead, inner)


@register("rms_norm", "pallas")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return _group_norm((x,), weight, eps, max(x.shape[-1], 1), "rms_norm")  # D = 0: empty


@register("gated_rms_norm", "pallas")
def gated_rms_norm(
    y: jax.Array, z: jax.Array, weight: jax.Array, eps: float, group_size: int
) -> jax.Array:
    return _group_norm((y, z), weight, eps, group_size, "gated_rms_norm")
