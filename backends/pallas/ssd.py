"""Mamba2 (SSD) as Pallas kernels: the one-token state update and the chunked scan.

Both use a grid over (batch row, ssm head); head h reads group h // (Hs / G) of b and c through
its BlockSpec index map, so the group broadcast is never materialised. The state tile [P, Ns]
is float32 throughout.

`mamba2_step`: each program loads its head's state [P, Ns], x [P], b and c [Ns] and the scalars
dt, a, d, and writes y [P] and the new state.

`mamba2_scan` (chunks of L tokens, L = min(chunk_size, 128): the result does not depend on it
beyond rounding). With `cum` the inclusive cumsum of `dt * a` within each chunk (computed in
XLA, like the padding), each chunk's output and state contribution are
      y_c = ((c b^T) * exp(cum_i - cum_j) [j <= i] * dt_j) x + d x + exp(cum) * (c h^T)
      S_c = (x * exp(cum_L - cum) dt)^T b,      h <- exp(cum_L) h + S_c     ([P, Ns], float32).
The registered op runs them in one pass: grid (row, head, slice of P), each program walking its
chunks in order with h in registers (nothing but x, b, c, dt in and y, the final state out).
The alternative (`one_pass=False`, kept for the benchmark) splits it in two phases:
  phase 1, grid (row, chunk, head), all independent: y_c without the inflow, and S_c;
  phase 2, grid (row, head, slice of P), sequential over chunks: adds `exp(cum) (c h^T)` to y in
    place and carries h (S_c goes through memory: float32, B * Hs * T / L * P * Ns * 4 bytes
    each way).
bfloat16 inputs use the tensor cores (bf16 operands, float32 accumulation; the [L, L] scores and
the carried state are rounded to bf16 only as matmul operands); float32 inputs multiply in full
float32 (no TF32).

Triton on GPU: every load/store must be a power-of-two tile, so the wrapper pads P and Ns to
powers of two and T to whole chunks (padding tokens carry dt = 0 and x = 0, which leaves the
state unchanged; padded state rows/columns stay zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from backends.pallas._common import dot, interpret, next_pow2, pad_axis, round_up, triton_params
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
        compiler_params=triton_params(),
        name="mamba2_step",
    )(state_p, pad_axis(x, 2, pp), dt, a, pad_axis(b, 2, nsp), pad_axis(c, 2, nsp), d)
    return y[:, :, :p], new_state[:, :, :p, :ns]


def _chunk_kernel(x_ref, dt_ref, cum_ref, last_ref, b_ref, c_ref, d_ref, y_ref, s_ref):
    """Phase 1, one (row, chunk, head): the chunk's own output and its state contribution."""
    x = x_ref[...]  # [L, P]
    dt = dt_ref[...].astype(F32)  # [L]
    cum = cum_ref[...]  # [L] inclusive cumsum of dt * a within the chunk
    b, c = b_ref[...], c_ref[...]  # [L, Ns]
    pos = jnp.arange(x.shape[0], dtype=jnp.int32)
    causal = pos[:, None] >= pos[None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
    scores = dot(c, b, 1, 1) * decay * dt[None, :]  # [L, L]
    y = dot(scores.astype(x.dtype), x, 1, 0) + d_ref[0].astype(F32) * x.astype(F32)
    y_ref[...] = y.astype(y_ref.dtype)
    weights = jnp.exp(last_ref[...] - cum) * dt  # [L]: decay from token to chunk end
    s_ref[...] = dot((x.astype(F32) * weights[:, None]).astype(x.dtype), b, 0, 0)


def _pass_kernel(c_ref, cum_ref, last_ref, s_ref, h0_ref, yd_ref, y_ref, hf_ref, *, length):
    """Phase 2, one (row, head, slice of P): carry the state through the chunks in order,
    adding each chunk's inflow `exp(cum) (c h^T)` to its output."""
    n_chunks = s_ref.shape[0]

    def chunk(k, h):
        rows = pl.ds(pl.multiple_of(k * length, length), length)
        cc = c_ref[rows, :]  # [L, Ns]
        inflow = jnp.exp(cum_ref[rows])[:, None] * dot(cc, h.astype(cc.dtype), 1, 1)
        y_ref[rows, :] = (yd_ref[rows, :].astype(F32) + inflow).astype(y_ref.dtype)
        decay = jnp.exp(last_ref[pl.ds(k, 1)]).reshape(1, 1)
        return decay * h + s_ref[pl.ds(k, 1), :, :].reshape(h.shape)

    hf_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(F32))


def _fused_kernel(
    x_ref, dt_ref, cum_ref, last_ref, b_ref, c_ref, d_ref, h0_ref, *refs, length, shared=False
):
    """One pass, one (row, head, slice of P): walk the chunks in order with the state in
    registers; each chunk's output is its own part plus the inflow from the carried state, and
    its state contribution is added before the next chunk (no chunk states in memory).
    `shared`: the chunks' `c b^T` [L, L] come in precomputed (one per group and chunk, float32),
    instead of every head and slice of P recomputing them."""
    cb_ref, y_ref, hf_ref = refs if shared else (None, *refs)
    n_chunks = last_ref.shape[0]
    d = d_ref[0].astype(F32)
    pos = jnp.arange(length, dtype=jnp.int32)
    causal = pos[:, None] >= pos[None, :]

    def chunk(k, h):
        rows = pl.ds(pl.multiple_of(k * length, length), length)
        x = x_ref[rows, :]  # [L, bp]
        dt = dt_ref[rows].astype(F32)  # [L]
        cum = cum_ref[rows]  # [L]
        b, c = b_ref[rows, :], c_ref[rows, :]  # [L, Ns]
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        cb = cb_ref[rows, :] if shared else dot(c, b, 1, 1)  # [L, L]
        scores = cb * decay * dt[None, :]
        y = dot(scores.astype(x.dtype), x, 1, 0) + d * x.astype(F32)
        y += jnp.exp(cum)[:, None] * dot(c, h.astype(c.dtype), 1, 1)
        y_ref[rows, :] = y.astype(y_ref.dtype)
        last = last_ref[pl.ds(k, 1)].reshape(1, 1)
        weights = jnp.exp(last - cum[:, None]) * dt[:, None]  # [L, 1]
        inflow = dot((x.astype(F32) * weights).astype(x.dtype), b, 0, 0)  # [bp, Ns]
        return jnp.exp(last) * h + inflow

    hf_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(F32))


MAX_CHUNK = 128  # the kernels' own chunk length cap ([L, L] scores stay in registers)


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
    # The one-pass kernel, chunks of 64; 2 pipeline stages when there are many programs (one
    # per row, head and slice of P), 3 when there are few: fastest on an H200 (BENCHMARKS.md).
    # P in slices of 64 where it divides, else of the largest power of two that does, so
    # nothing is padded: P 80 in slices of 16 took 0.112 ms against 0.126 in (padded) 64s
    # (the 9B prefill row, 512 tokens).
    p = x.shape[3]
    block_p = 64
    while p % block_p and block_p > 16:
        block_p //= 2
    stages = 2 if x.shape[0] * x.shape[2] >= 512 else 3
    return mamba2_scan_tiled(
        x, dt, a, b, c, d, initial_state, min(chunk_size, 64), block_p=block_p, num_warps=4,
        num_stages=stages, one_pass=True,
    )  # fmt: skip


def mamba2_scan_tiled(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    initial_state: jax.Array,
    chunk_size: int,
    *,
    block_p: int = 16,
    num_warps: int | None = None,
    num_stages: int | None = None,
    one_pass: bool = False,
    shared_scores: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`mamba2_scan` with explicit tiles (the benchmark sweeps them): `block_p` state rows per
    sequential program; `one_pass` runs the fused kernel instead of the two phases;
    `shared_scores` (one pass only): each chunk's `c b^T` computed once per group in XLA
    (float32, [B, G, T, L]) and read by every head of the group and slice of P."""
    bsz, t, nh, p = x.shape
    groups, ns = b.shape[2], b.shape[3]
    rep = nh // groups
    interp = interpret()
    length = min(next_pow2(min(chunk_size, t)), MAX_CHUNK)
    if not interp:
        length = max(length, 16)  # Triton's tl.dot wants every dim >= 16
    tp, nsp = round_up(t, length), next_pow2(ns)
    nc = tp // length
    bp = min(next_pow2(p), max(block_p, 1 if interp else 16))
    # whole slices of P for the one-pass kernel (80 in slices of 16: no padding; of 64: 128);
    # the two-phase kernels take P whole, as one power-of-two tile
    pp = round_up(p, bp) if one_pass else next_pow2(p)
    # Padding tokens carry dt = 0 and x = 0: the state passes through them unchanged.
    xs = pad_axis(pad_axis(x, 1, tp), 3, pp)
    dts = pad_axis(dt, 1, tp)
    bs = pad_axis(pad_axis(b, 1, tp), 3, nsp)
    cs = pad_axis(pad_axis(c, 1, tp), 3, nsp)
    h0 = pad_axis(pad_axis(initial_state.astype(F32), 2, pp), 3, nsp)
    dta = (dts.astype(F32) * a.astype(F32)).reshape(bsz, nc, length, nh)
    cum = jnp.cumsum(dta, axis=2)  # [B, nc, L, Hs]
    last = cum[:, :, -1, :]  # [B, nc, Hs]
    cum = cum.reshape(bsz, tp, nh)
    # Specs of the sequential programs, grid (row, head, slice of P).
    seq_tok = lambda w: pl.BlockSpec((None, tp, None, w), lambda i, h, j: (i, 0, h, j))  # noqa: E731
    seq_grp = pl.BlockSpec((None, tp, None, nsp), lambda i, h, j: (i, 0, h // rep, 0))
    seq_vec = pl.BlockSpec((None, tp, None), lambda i, h, j: (i, 0, h))
    seq_last = pl.BlockSpec((None, nc, None), lambda i, h, j: (i, 0, h))
    seq_state = pl.BlockSpec((None, None, bp, nsp), lambda i, h, j: (i, h, j, 0))
    out_shape = (
        jax.ShapeDtypeStruct((bsz, tp, nh, pp), x.dtype),
        jax.ShapeDtypeStruct((bsz, nh, pp, nsp), F32),
    )
    if one_pass:
        in_specs = [seq_tok(bp), seq_vec, seq_vec, seq_last, seq_grp, seq_grp]
        in_specs += [pl.BlockSpec((1,), lambda i, h, j: (h,)), seq_state]
        args = [xs, dts, cum, last, bs, cs, d, h0]
        if shared_scores:  # cb[b, g, z L + i, j] = c[z L + i] . b[z L + j] within chunk z
            chunked = lambda v: v.reshape(bsz, nc, length, groups, nsp)  # noqa: E731
            cb = jnp.einsum("bzign,bzjgn->bgzij", chunked(cs), chunked(bs),
                            preferred_element_type=F32)  # fmt: skip
            args.append(cb.reshape(bsz, groups, tp, length))
            in_specs.append(
                pl.BlockSpec((None, None, tp, length), lambda i, h, j: (i, h // rep, 0, 0))
            )
        y, final = pl.pallas_call(
            functools.partial(_fused_kernel, length=length, shared=shared_scores),
            out_shape=out_shape,
            grid=(bsz, nh, pp // bp),
            in_specs=in_specs,
            out_specs=(seq_tok(bp), seq_state),
            interpret=interp,
            compiler_params=triton_params(num_warps, num_stages),
            name="mamba2_one_pass",
        )(*args)
        return y[:, :t, :, :p], final[:, :, :p, :ns]
    tok = lambda w: pl.BlockSpec((None, length, None, w), lambda i, k, h: (i, k, h, 0))  # noqa: E731
    grp = pl.BlockSpec((None, length, None, nsp), lambda i, k, h: (i, k, h // rep, 0))
    vec = pl.BlockSpec((None, length, None), lambda i, k, h: (i, k, h))
    y_diag, states = pl.pallas_call(
        _chunk_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, tp, nh, pp), x.dtype),
            jax.ShapeDtypeStruct((bsz, nh, nc, pp, nsp), F32),
        ),
        grid=(bsz, nc, nh),
        in_specs=[
            tok(pp),
            vec,
            vec,
            pl.BlockSpec((None, None, 1), lambda i, k, h: (i, k, h)),
            grp,
            grp,
            pl.BlockSpec((1,), lambda i, k, h: (h,)),
        ],
        out_specs=(
            tok(pp),
            pl.BlockSpec((None, None, None, pp, nsp), lambda i, k, h: (i, h, k, 0, 0)),
        ),
        interpret=interp,
        compiler_params=triton_params(num_warps or (8 if length >= 128 else 4)),
        name="mamba2_chunks",
    )(xs, dts, cum, last, bs, cs, d)
    y, final = pl.pallas_call(
        functools.partial(_pass_kernel, length=length),
        out_shape=out_shape,
        grid=(bsz, nh, pp // bp),
        in_specs=[
            seq_grp,
            seq_vec,
            seq_last,
            pl.BlockSpec((None, None, nc, bp, nsp), lambda i, h, j: (i, h, 0, j, 0)),
            seq_state,
            seq_tok(bp),
        ],
        out_specs=(seq_tok(bp), seq_state),
        input_output_aliases={5: 0},  # y is written over the chunk outputs, in place
        interpret=interp,
        compiler_params=triton_params(),
        name="mamba2_state_pass",
    )(cs, cum, last, states, h0, y_diag)
    return y[:, :t, :, :p], final[:, :, :p, :ns]
