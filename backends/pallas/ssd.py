"""Mamba2 (SSD) as Pallas kernels: the one-token state update.

A grid over (batch row, ssm head); head h reads group h // (Hs / G) of b and c through
its BlockSpec index map, so the group broadcast is never materialised. The state tile [P, Ns]
is float32 throughout.

`mamba2_step`: each program loads its head's state [P, Ns], x [P], b and c [Ns] and the scalars
dt, a, d, and writes y [P] and the new state.

Triton on GPU: every load/store must be a power-of-two tile, so the wrapper pads P and Ns to
powers of two (padded state rows/columns stay zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends.pallas._common import interpret, next_pow2, pad_axis
from backends.protocol import register

F32 = jnp.float32


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
        name="mamba2_step",
    )(state_p, pad_axis(x, 2, pp), dt, a, pad_axis(b, 2, nsp), pad_axis(c, 2, nsp), d)
    return y[:, :, :p], new_state[:, :, :p, :ns]
