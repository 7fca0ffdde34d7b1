"""Mamba2 (SSD) as Pallas kernels: the one-token state update and the chunked scan.

Both use a grid over (batch row, ssm head); head h reads group h // (Hs / G) of b and c through
its BlockSpec index map, so the group broadcast is never materialised. The state tile [P, Ns]
is float32 throughout.

`mamba2_step`: each program loads its head's state [P, Ns], x [P], b and c [Ns] and the scalars
dt, a, d, and writes y [P] and the new state.

`mamba2_scan` (first version): each program loops over the chunks of its (row, head) in order,
keeping the running state in registers. Per chunk of L tokens, with `cum` the inclusive cumsum
of `dt * a` (computed as a masked row sum, no scan primitive):
  y     = ((c b^T) * exp(cum_i - cum_j) [j <= i] * dt_j) x  +  exp(cum) * (c h^T)  +  d x
  h_new = exp(cum_L) h + (x * exp(cum_L - cum) dt)^T b
The matmuls are `dot_general`s of power-of-two tiles (L, P, Ns >= 16 on GPU for tensor cores).

Triton on GPU: every load/store must be a power-of-two tile, so the wrapper pads P and Ns to
powers of two and T to whole chunks (padding tokens carry dt = 0 and x = 0, which leaves the
state unchanged; padded state rows/columns stay zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends.pallas._common import interpret, next_pow2, pad_axis, round_up, triton_params
from backends.protocol import register

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def _dot(lhs: jax.Array, rhs: jax.Array, lhs_contract: int, rhs_contract: int) -> jax.Array:
    """2-D matmul contracting the given axes, float32 accumulation, no TF32."""
    return jax.lax.dot_general(
        lhs,
        rhs,
        (((lhs_contract,), (rhs_contract,)), ((), ())),
        precision=HIGHEST,
        preferred_element_type=F32,
    )


def _step_kernel(s_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, y_ref, ns_ref):
    x = x_ref[...].astype(F32)  # [P]
    dt = dt_ref[0, 0].astype(F32)
    decay = jnp.exp(dt * a_ref[0].astype(F32))
    b = b_ref[...].astype(F32)  # [Ns]
    c = c_ref[...].astype(F32)
    state = decay * s_ref[...] + (dt * x)[:, None] * b[None, :]  # [P, Ns]
    ns_ref[...] = state
    y = jnp.sum(state * c[None, :], axis=1) + d_ref[0].astype(F32) * x
    y_ref[...] = y.astype(y_ref.dtype)


@register("mamba2_step", "pallas")
def mamba2_step(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    bsz, nh, p = x.shape
    groups, ns = b.shape[1], b.shape[2]
    rep = nh // groups
    pp, nsp = next_pow2(p), next_pow2(ns)
    state_p = pad_axis(pad_axis(state.astype(F32), 2, pp), 3, nsp)
    y, new_state = pl.pallas_call(
        _step_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, nh, pp), x.dtype),
            jax.ShapeDtypeStruct((bsz, nh, pp, nsp), F32),
        ),
        grid=(bsz, nh),
        in_specs=[
            pl.BlockSpec((None, None, pp, nsp), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((None, None, pp), lambda i, h: (i, h, 0)),
            pl.BlockSpec((1, 1), lambda i, h: (i, h)),
            pl.BlockSpec((1,), lambda i, h: (h,)),
            pl.BlockSpec((None, None, nsp), lambda i, h: (i, h // rep, 0)),
            pl.BlockSpec((None, None, nsp), lambda i, h: (i, h // rep, 0)),
            pl.BlockSpec((1,), lambda i, h: (h,)),
        ],
        out_specs=(
            pl.BlockSpec((None, None, pp), lambda i, h: (i, h, 0)),
            pl.BlockSpec((None, None, pp, nsp), lambda i, h: (i, h, 0, 0)),
        ),
        interpret=interpret(),
        compiler_params=triton_params(),
        name="mamba2_step",
    )(state_p, pad_axis(x, 2, pp), dt, a, pad_axis(b, 2, nsp), pad_axis(c, 2, nsp), d)
    return y[:, :, :p], new_state[:, :, :p, :ns]


def _scan_kernel(
    x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, h0_ref, y_ref, hf_ref, *, n_chunks, length
):
    a = a_ref[0].astype(F32)
    d = d_ref[0].astype(F32)
    pos = jnp.arange(length, dtype=jnp.int32)
    causal = pos[:, None] >= pos[None, :]  # [i, j]: j <= i

    def chunk(k, h):
        rows = pl.ds(pl.multiple_of(k * length, length), length)
        xc = x_ref[rows, :].astype(F32)  # [len, P]
        dtc = dt_ref[rows].astype(F32)  # [len]
        bc = b_ref[rows, :].astype(F32)  # [len, Ns]
        cc = c_ref[rows, :].astype(F32)
        la = dtc * a
        cum = jnp.sum(jnp.where(causal, la[None, :], 0.0), axis=1)  # inclusive cumsum
        total = jnp.sum(la)
        seg = cum[:, None] - cum[None, :]
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, seg, 0.0)), 0.0)
        scores = _dot(cc, bc, 1, 1) * decay * dtc[None, :]  # [len, len]
        y = _dot(scores, xc, 1, 0) + jnp.exp(cum)[:, None] * _dot(cc, h, 1, 1) + d * xc
        y_ref[rows, :] = y.astype(y_ref.dtype)
        weights = jnp.exp(total - cum) * dtc  # [len]
        return jnp.exp(total) * h + _dot(xc * weights[:, None], bc, 0, 0)  # [P, Ns]

    hf_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(F32))


@register("mamba2_scan", "pallas")
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
    groups, ns = b.shape[2], b.shape[3]
    rep = nh // groups
    interp = interpret()
    length = next_pow2(min(chunk_size, t))
    if not interp:
        length = max(length, 16)  # Triton's tl.dot wants every dim >= 16
    tp, pp, nsp = round_up(t, length), next_pow2(p), next_pow2(ns)
    # Padding tokens carry dt = 0 and x = 0: the state passes through them unchanged.
    xs = pad_axis(pad_axis(x, 1, tp), 3, pp)
    dts = pad_axis(dt, 1, tp)
    bs = pad_axis(pad_axis(b, 1, tp), 3, nsp)
    cs = pad_axis(pad_axis(c, 1, tp), 3, nsp)
    h0 = pad_axis(pad_axis(initial_state.astype(F32), 2, pp), 3, nsp)
    kernel = functools.partial(_scan_kernel, n_chunks=tp // length, length=length)
    y, final = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, tp, nh, pp), x.dtype),
            jax.ShapeDtypeStruct((bsz, nh, pp, nsp), F32),
        ),
        grid=(bsz, nh),
        in_specs=[
            pl.BlockSpec((None, tp, None, pp), lambda i, h: (i, 0, h, 0)),
            pl.BlockSpec((None, tp, None), lambda i, h: (i, 0, h)),
            pl.BlockSpec((1,), lambda i, h: (h,)),
            pl.BlockSpec((None, tp, None, nsp), lambda i, h: (i, 0, h // rep, 0)),
            pl.BlockSpec((None, tp, None, nsp), lambda i, h: (i, 0, h // rep, 0)),
            pl.BlockSpec((1,), lambda i, h: (h,)),
            pl.BlockSpec((None, None, pp, nsp), lambda i, h: (i, h, 0, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, tp, None, pp), lambda i, h: (i, 0, h, 0)),
            pl.BlockSpec((None, None, pp, nsp), lambda i, h: (i, h, 0, 0)),
        ),
        interpret=interp,
        compiler_params=triton_params(),
        name="mamba2_scan",
    )(xs, dts, a, bs, cs, d, h0)
    return y[:, :t, :, :p], final[:, :, :p, :ns]
