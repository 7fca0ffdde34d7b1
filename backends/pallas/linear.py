"""`linear` as a Pallas GEMV / skinny GEMM with its norm, bias, activation and residual inside.

For x [M, K] (M <= MAX_ROWS tokens) and w [N, K] (one row per output feature), each program
owns `bn` output features, i.e. `bn` contiguous rows of w, and walks K in chunks of `bk`:
  pass 1 (with a norm): the float32 statistics of its M rows of x (every program recomputes
          them: x is a few KB, read from L2, against bn * K * 2 bytes of weights);
  pass 2: x' = norm(x) chunk by chunk (rounded to x's dtype as `rms_norm` / `gated_rms_norm`
          round it), acc += x' w_chunk^T: a broadcast multiply and row sums when M = 1, the
          tensor cores (rows padded to 16) otherwise;
  epilogue: y = acc rounded, + bias, activation, `residual + scale * y`, each step rounded to
          x's dtype as the unfused ops are, stored for its M rows.
So a decode layer's norm, GEMV, activation and residual add are one kernel, and the weights
stream row by row (16-byte loads along K) at the copy bandwidth. Larger M (prefill) goes to the
xla reference, whose GEMMs are compute-bound there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from backends.fused import Norm
from backends.pallas._common import dot, interpret, next_pow2, triton_params
from backends.protocol import register
from backends.xla.linear import ACTIVATIONS, check_linear
from backends.xla.linear import linear as linear_reference

F32 = jnp.float32
MAX_ROWS = 16  # tokens the kernel takes; more go to the reference (compute-bound GEMMs)


def _act(y: jax.Array, name: str | None) -> jax.Array:
    if name == "relu2":
        r = jnp.maximum(y, 0.0)
        return r * r
    if name == "silu":
        return y / (1.0 + jnp.exp(-y))
    return y


def _kernel(
    x_ref,
    w_ref,
    *refs,
    m: int,
    mp: int,
    k: int,
    n: int,
    bn: int,
    bk: int,
    norm: str | None,
    eps: float,
    group: int,
    gate_offset: int,
    act: str | None,
    scale: float,
    has_bias: bool,
    has_res: bool,
):
    refs = list(refs)
    norm_w_ref = refs.pop(0) if norm else None
    gate_ref = refs.pop(0) if norm == "gated" else None
    bias_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if has_res else None
    (o_ref,) = refs
    dtype = x_ref.dtype
    n0 = pl.program_id(0) * bn
    rows = jax.lax.broadcasted_iota(jnp.int32, (mp,), 0)
    row_ok = rows < m
    cols = n0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    col_ok = cols < n
    full, tail = k // bk, k % bk

    def load_x(k0, masked):  # [mp, bk] x (and the gated product) in float32
        ks = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        ok = row_ok[:, None] & ((ks < k)[None, :] if masked else True)
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=ok, other=0).astype(F32)
        if norm == "gated":
            zs = gate_offset + ks
            z = plgpu.load(gate_ref.at[rows[:, None], zs[None, :]], mask=ok, other=0).astype(F32)
            x = x * (z / (1.0 + jnp.exp(-z)))
        return x, ks

    def chunks(body, init):  # body(k0, masked, carry) over the whole chunks, then the tail
        carry = jax.lax.fori_loop(0, full, lambda i, c: body(i * bk, False, c), init)
        return body(full * bk, True, carry) if tail else carry

    groups = max(k // group, 1) if norm == "gated" else 1
    gp = next_pow2(groups)
    gids = jax.lax.broadcasted_iota(jnp.int32, (gp,), 0)
    if norm:

        def stats(k0, masked, ss):  # sums of squares per row (and group)
            x, _ = load_x(k0, masked)
            s = jnp.sum(x * x, axis=1)[:, None]  # [mp, 1]
            if norm == "gated":
                return ss + jnp.where(gids[None, :] == k0 // group, s, 0.0)
            return ss + s

        ss = chunks(stats, jnp.zeros((mp, gp if norm == "gated" else 1), F32))
        rstd = jax.lax.rsqrt(ss / (group if norm == "gated" else k) + eps)

    def prologue(k0, masked):  # [mp, bk] x' in x's dtype
        x, ks = load_x(k0, masked)
        if not norm:
            return x.astype(dtype)
        if norm == "gated":
            r = jnp.sum(jnp.where(gids[None, :] == k0 // group, rstd, 0.0), axis=1)[:, None]
        else:
            r = rstd
        wn = plgpu.load(norm_w_ref.at[ks], mask=ks < k, other=0).astype(F32)
        return ((x * r).astype(dtype).astype(F32) * wn[None, :]).astype(dtype)

    def step(k0, masked, acc):
        xs = prologue(k0, masked)
        ks = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        ok = col_ok[:, None] & ((ks < k)[None, :] if masked else True)
        w = plgpu.load(w_ref.at[cols[:, None], ks[None, :]], mask=ok, other=0)  # [bn, bk]
        if mp == 1:  # a GEMV: broadcast multiply, row sums
            return acc + jnp.sum(w.astype(F32) * xs.astype(F32), axis=1)[None, :]
        return acc + dot(xs, w.astype(dtype), 1, 1)  # [mp, bn] on the tensor cores

    acc = chunks(step, jnp.zeros((mp, bn), F32))
    y = acc.astype(dtype).astype(F32)
    if has_bias:
        b = plgpu.load(bias_ref.at[cols], mask=col_ok, other=0).astype(F32)
        y = (y + b[None, :]).astype(dtype).astype(F32)
    if act:
        y = _act(y, act).astype(dtype).astype(F32)
    ok = row_ok[:, None] & col_ok[None, :]
    if has_res:
        r = plgpu.load(res_ref.at[rows[:, None], cols[None, :]], mask=ok, other=0).astype(F32)
        y = r + (scale * y).astype(dtype).astype(F32)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], y.astype(o_ref.dtype), mask=ok)


def tiles(m: int, n: int, k: int, group: int = 0) -> tuple[int, int, int]:
    """(bn, bk, num_warps) for M rows of x times an [N, K] weight (measured on an H200 in
    BENCHMARKS.md, "the fused projections")."""
    bn = 16 if m <= 1 else 32
    bk = 512 if m <= 1 else 256
    if group:  # a chunk must lie inside one norm group
        while group % bk:
            bk //= 2
    return bn, bk, 4


@register("linear", "pallas")
def linear(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    norm: Norm | None = None,
    activation: str | None = None,
    residual: jax.Array | None = None,
    scale: float = 1.0,
) -> jax.Array:
    m = x.size // max(x.shape[-1], 1)
    if m > MAX_ROWS or m == 0:
        return linear_reference(x, w, bias, norm, activation, residual, scale)
    n, k = w.shape
    group = (norm.group_size or k) if norm is not None and norm.gate is not None else 0
    bn, bk, warps = tiles(m, n, k, group)
    return linear_tiled(x, w, bias, norm, activation, residual, scale, bn=bn, bk=bk, warps=warps)


def linear_tiled(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    norm: Norm | None = None,
    activation: str | None = None,
    residual: jax.Array | None = None,
    scale: float = 1.0,
    *,
    bn: int,
    bk: int,
    warps: int = 4,
    stages: int | None = None,
) -> jax.Array:
    """`linear` with explicit tiles (`bn` output rows and `bk` of K per step, powers of two);
    the benchmark sweeps them."""
    check_linear(x, w, bias, norm, activation, residual)
    *lead, k = x.shape
    n = w.shape[0]
    m = x.size // k
    mp = 1 if m == 1 else max(16, next_pow2(m))
    gated = norm is not None and norm.gate is not None
    group = (norm.group_size or k) if gated else 0
    if gated and (group % bk or k % group):
        raise ValueError(f"a chunk of {bk} must lie inside one norm group of {group} (K = {k})")
    args = [x.reshape(m, k), w]
    if norm is not None:
        args.append(norm.weight)
        if gated:
            args.append(norm.gate.reshape(m, norm.gate.shape[-1]))
    if bias is not None:
        args.append(bias)
    if residual is not None:
        args.append(residual.reshape(m, n))
    kernel = functools.partial(
        _kernel,
        m=m,
        mp=mp,
        k=k,
        n=n,
        bn=bn,
        bk=bk,
        norm=None if norm is None else ("gated" if gated else "rms"),
        eps=0.0 if norm is None else float(norm.eps),
        group=group,
        gate_offset=norm.gate_offset if gated else 0,
        act=activation,
        scale=float(scale),
        has_bias=bias is not None,
        has_res=residual is not None,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(n, bn),),
        interpret=interpret(),
        compiler_params=triton_params(num_warps=warps, num_stages=stages),
        name="linear",
    )(*args)
    return out.reshape(*lead, n)


__all__ = ["ACTIVATIONS", "linear", "linear_tiled", "tiles"]
