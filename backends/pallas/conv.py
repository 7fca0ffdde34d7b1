"""Causal depthwise conv1d ("sconv", width <= 4) as Pallas kernels.

Chunk kernel: grid (batch row, channel block). The wrapper lays out, per row, the W-1 carried
inputs followed by the chunk (`u`, time-major, zero-padded to whole time tiles) so that every
load is an in-bounds power-of-two tile; each program loops over time tiles of BT rows, loads
the W shifted [BT, BC] windows of its channel block, and writes y and the new state (the W-1
inputs ending at the row's last valid token, read with a dynamic offset).

Step kernel: same grid; loads the DS state columns and x, writes y and the shifted state.

On GPU (Triton) every load/store must be a power-of-two tile: BT and BC are powers of two and
the wrapper pads channels and time; block shapes themselves may be arbitrary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends.pallas._common import interpret, next_pow2, pad_axis, round_up, triton_params
from backends.protocol import register

MAX_BLOCK_C = 64
MAX_BLOCK_T = 32


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    if activation is None:
        return y
    if activation == "silu":
        return y / (1.0 + jnp.exp(-y))
    raise ValueError(f"unsupported conv activation {activation!r} (use 'silu' or None)")


def _check(weight: jax.Array, activation: str | None) -> int:
    width = weight.shape[1]
    if not 2 <= width <= 4:
        raise ValueError(f"causal conv width must be 2..4, got {width}")
    _activate(jnp.zeros(()), activation)  # validates the name
    return width


def _conv_kernel(len_ref, u_ref, w_ref, b_ref, y_ref, s_ref, *, width, n_tiles, bt, activation):
    w = [w_ref[k, :].astype(jnp.float32) for k in range(width)]  # each [BC]
    bias = b_ref[0, :].astype(jnp.float32)

    def tile(i, carry):
        t0 = pl.multiple_of(i * bt, bt)
        acc = bias[None, :] + jnp.zeros((bt, bias.shape[0]), jnp.float32)
        for k in range(width):
            acc = acc + u_ref[pl.ds(t0 + k, bt), :].astype(jnp.float32) * w[k][None, :]
        y_ref[pl.ds(t0, bt), :] = _activate(acc, activation).astype(y_ref.dtype)
        return carry

    jax.lax.fori_loop(0, n_tiles, tile, 0)
    # New state: u[len : len + W-1], the W-1 inputs ending at the last valid token.
    length = len_ref[0]
    for j in range(width - 1):
        s_ref[pl.ds(j, 1), :] = u_ref[pl.ds(length + j, 1), :].astype(s_ref.dtype)


@register("causal_conv1d", "pallas")
def causal_conv1d(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    lengths: jax.Array,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    bsz, t, ch = x.shape
    width = _check(weight, activation)
    bc = min(next_pow2(ch), MAX_BLOCK_C)
    bt = min(next_pow2(t), MAX_BLOCK_T)
    cp, tp = round_up(ch, bc), round_up(t, bt)
    # u: [B, Tp + W-1, Cp]: W-1 carried inputs, then x, then zeros (tile loads stay in bounds).
    u = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(x.dtype), x], axis=1)
    u = pad_axis(pad_axis(u, 1, tp + width - 1), 2, cp)
    w_t = pad_axis(weight.T, 1, cp)  # [W, Cp]
    b = jnp.zeros((cp,), jnp.float32) if bias is None else pad_axis(bias, 0, cp)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, t)
    kernel = functools.partial(
        _conv_kernel, width=width, n_tiles=tp // bt, bt=bt, activation=activation
    )
    y, s = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, tp, cp), x.dtype),
            jax.ShapeDtypeStruct((bsz, width - 1, cp), state.dtype),
        ),
        grid=(bsz, cp // bc),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((None, tp + width - 1, bc), lambda i, j: (i, 0, j)),
            pl.BlockSpec((width, bc), lambda i, j: (0, j)),
            pl.BlockSpec((1, bc), lambda i, j: (0, j)),
        ],
        out_specs=(
            pl.BlockSpec((None, tp, bc), lambda i, j: (i, 0, j)),
            pl.BlockSpec((None, width - 1, bc), lambda i, j: (i, 0, j)),
        ),
        interpret=interpret(),
        compiler_params=triton_params(),
        name="causal_conv1d",
    )(lengths, u, w_t, b[None, :])
    return y[:, :t, :ch], jnp.swapaxes(s[:, :, :ch], 1, 2)


def _step_kernel(x_ref, s_ref, w_ref, b_ref, y_ref, ns_ref, *, width, activation):
    x = x_ref[...]
    # The window in x's dtype, as the reference forms it: W-1 carried inputs, then x.
    cols = [s_ref[:, j].astype(x.dtype) for j in range(width - 1)] + [x]
    acc = b_ref[0, :].astype(jnp.float32)
    for k in range(width):
        acc = acc + cols[k].astype(jnp.float32) * w_ref[k, :].astype(jnp.float32)
    y_ref[...] = _activate(acc, activation).astype(y_ref.dtype)
    for j in range(width - 1):
        ns_ref[:, j] = cols[j + 1].astype(ns_ref.dtype)


@register("causal_conv1d_step", "pallas")
def causal_conv1d_step(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    bsz, ch = x.shape
    width = _check(weight, activation)
    bc = min(next_pow2(ch), MAX_BLOCK_C)
    cp = round_up(ch, bc)
    w_t = pad_axis(weight.T, 1, cp)  # [W, Cp]
    b = jnp.zeros((cp,), jnp.float32) if bias is None else pad_axis(bias, 0, cp)
    kernel = functools.partial(_step_kernel, width=width, activation=activation)
    y, s = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, cp), x.dtype),
            jax.ShapeDtypeStruct((bsz, cp, width - 1), state.dtype),
        ),
        grid=(bsz, cp // bc),
        in_specs=[
            pl.BlockSpec((None, bc), lambda i, j: (i, j)),
            pl.BlockSpec((None, bc, width - 1), lambda i, j: (i, j, 0)),
            pl.BlockSpec((width, bc), lambda i, j: (0, j)),
            pl.BlockSpec((1, bc), lambda i, j: (0, j)),
        ],
        out_specs=(
            pl.BlockSpec((None, bc), lambda i, j: (i, j)),
            pl.BlockSpec((None, bc, width - 1), lambda i, j: (i, j, 0)),
        ),
        interpret=interpret(),
        compiler_params=triton_params(),
        name="causal_conv1d_step",
    )(pad_axis(x, 1, cp), pad_axis(state, 1, cp), w_t, b[None, :])
    return y[:, :ch], s[:, :ch]
