"""`linear` as a Pallas GEMV with its norm, bias, activation and residual inside.

For one row x [1, K] and w [N, K] (one row per output feature), each program owns `bn` output
features, i.e. `bn` contiguous rows of w, and walks K in chunks of `bk` (16-byte loads along
K), accumulating the products elementwise in a [bn, bk] tile that is summed once at the end:
  acc[n] = sum_k w[n, k] x'[k],   x' = x * scale(k) * norm_weight  (x * silu(z) gated).
RMSNorm's scale is one scalar, `1 / sqrt(mean(x^2) + eps)`, applied after the sum (its sum
of squares accumulates in the same pass); a group norm's scale depends on k's group, so its
statistics come first, in a pass over x alone (a few KB, from L2), and a chunk (bk <= group)
spans at most two groups. The unfused ops round the normed x to x's dtype before the GEMM;
here it stays float32, within one rounding of them. Then the epilogue: y rounded, + bias, the
activation, `residual + scale * y`, each step rounded to x's dtype as the unfused ops round it.
So a decode layer's norm, GEMV, activation and residual add are one kernel. Small tiles of N
(`tiles`) keep each program short and the grid many waves deep, so the last wave costs little.
More than one row (prefill, batches) goes to the xla reference: at 8 rows a kernel of this
shape ran 4-20x slower than XLA's GEMM on an H200 (BENCHMARKS.md, "the fused projections").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from backends.fused import Norm
from backends.pallas._common import interpret, next_pow2, triton_params
from backends.protocol import register
from backends.xla.linear import ACTIVATIONS, check_linear
from backends.xla.linear import linear as linear_reference

F32 = jnp.float32


def _act(y: jax.Array, name: str | None) -> jax.Array:
    if name == "relu2":
        r = jnp.maximum(y, 0.0)
        return r * r
    if name == "silu":
        return y / (1.0 + jnp.exp(-y))
    return y


def _load(ref: jax.Array, mask: jax.Array | None) -> jax.Array:
    """A load, masked (zeros elsewhere) when `mask` is given (Triton takes `other` only then)."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _kernel(
    x_ref,
    w_ref,
    *refs,
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
    cols = pl.program_id(0) * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    col_ok = cols < n
    size = group if norm in ("gated", "group") else k  # the norm's group (or the whole row)
    grouped = norm is not None and size < k
    full, tail = k // bk, k % bk
    gids = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(k // size),), 0)

    def keys(start, end):  # the chunk's k and its mask (None: a whole chunk)
        ks = start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        return ks, None if end is None else ks < end

    def x_at(ks, k_ok):  # x (times silu(z) when gated), float32 [bk]
        x = _load(x_ref.at[0, ks], k_ok).astype(F32)
        if norm == "gated":
            z = _load(gate_ref.at[0, gate_offset + ks], k_ok).astype(F32)
            x = x * (z / (1.0 + jnp.exp(-z)))
        return x

    def chunks(body, init):  # body(start, end, carry) over K: whole chunks, then the tail
        carry = jax.lax.fori_loop(0, full, lambda i, c: body(i * bk, None, c), init)
        return body(full * bk, k, carry) if tail else carry

    def two_groups(start):  # a chunk's first group, and which of its keys lie in it
        g = start // size
        ks = start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        return g, ks // size == g

    if grouped:  # each group's sum of squares first (x alone)

        def stats(start, end, ss):
            ks, k_ok = keys(start, end)
            x2 = x_at(ks, k_ok) ** 2
            g, first = two_groups(start)
            lo = jnp.sum(jnp.where(first, x2, 0.0))
            hi = jnp.sum(x2) - lo
            return ss + jnp.where(gids == g, lo, 0.0) + jnp.where(gids == g + 1, hi, 0.0)

        rstd = jax.lax.rsqrt(chunks(stats, jnp.zeros(gids.shape, F32)) / size + eps)

    def step(start, end, carry):
        acc, ssq = carry
        ks, k_ok = keys(start, end)
        ok = col_ok[:, None] & (True if k_ok is None else k_ok[None, :])
        w = plgpu.load(w_ref.at[cols[:, None], ks[None, :]], mask=ok, other=0).astype(F32)
        x = x_at(ks, k_ok)
        if grouped:  # the scale of each key's group (of at most two)
            g, first = two_groups(start)
            r_lo = jnp.sum(jnp.where(gids == g, rstd, 0.0))
            r_hi = jnp.sum(jnp.where(gids == g + 1, rstd, 0.0))
            x = x * jnp.where(first, r_lo, r_hi)
        elif norm:
            ssq = ssq + x * x
        if norm:
            x = x * _load(norm_w_ref.at[ks], k_ok).astype(F32)
        return acc + w * x[None, :], ssq

    acc, ssq = chunks(step, (jnp.zeros((bn, bk), F32), jnp.zeros((bk,), F32)))
    acc = jnp.sum(acc, axis=1)
    if norm and not grouped:  # RMSNorm's one scale, after the sum
        acc = acc * jax.lax.rsqrt(jnp.sum(ssq) / k + eps)
    y = acc.astype(dtype).astype(F32)
    if has_bias:
        b = plgpu.load(bias_ref.at[cols], mask=col_ok, other=0).astype(F32)
        y = (y + b).astype(dtype).astype(F32)
    if act:
        y = _act(y, act).astype(dtype).astype(F32)
    if has_res:
        res = plgpu.load(res_ref.at[0, cols], mask=col_ok, other=0).astype(F32)
        y = res + (scale * y).astype(dtype).astype(F32)
    plgpu.store(o_ref.at[0, cols], y.astype(o_ref.dtype), mask=col_ok)


def tiles(n: int, k: int, group: int = 0) -> tuple[int, int, int]:
    """(bn, bk, num_warps) for one row of x times an [N, K] weight (measured on an H200 in
    BENCHMARKS.md, "the fused projections")."""
    bk = 1024
    while group and bk > group:  # a chunk spans at most two norm groups
        bk //= 2
    return 4, bk, 4


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
    if x.size != x.shape[-1] or x.size == 0:  # more than one row: the reference's GEMM
        return linear_reference(x, w, bias, norm, activation, residual, scale)
    n, k = w.shape
    group = 0 if norm is None else norm.group_size if norm.group_size != k else 0
    bn, bk, warps = tiles(n, k, group)
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
    if m != 1:
        raise ValueError(f"the kernel takes one row of x, got {m}")
    gated = norm is not None and norm.gate is not None
    grouped = norm is not None and norm.group_size not in (0, k)
    group = (norm.group_size or k) if gated or grouped else 0
    if group and (bk > group or k % group):
        raise ValueError(f"a chunk of {bk} may span at most two norm groups of {group} (K = {k})")
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
        k=k,
        n=n,
        bn=bn,
        bk=bk,
        norm=None if norm is None else ("gated" if gated else "group" if grouped else "rms"),
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
