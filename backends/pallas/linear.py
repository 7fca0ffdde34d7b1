"""`linear` as a Pallas GEMV with its norm, bias, activation and residual inside.

For x [M, K] (M <= MAX_ROWS tokens) and w [N, K] (one row per output feature), each program
owns `bn` output features, i.e. `bn` contiguous rows of w, and walks K once, in chunks of `bk`
(16-byte loads along K; the tile is reused for every row of x):
  part_r += sum_k w[:, k] * x'_r[k],   x' = x * norm_weight (x * silu(z) * norm_weight gated),
  ss_r   += sum_k x_r[k]^2            (x * silu(z) gated), per norm group,
and at the end of each group `acc_r += part_r / sqrt(ss_r / size + eps)`: the norm's scale is
a per-row (per-group) scalar, so it is applied after the sum and the norm costs no second pass
over x (the unfused ops round the normed x to x's dtype before the GEMM; here it stays float32,
within one rounding of them).

A chunk never crosses a group: the last chunk of a group is masked where bk does not divide
it. With `splits` > 1 the grid also splits K (each program whole groups; Mamba2's output
projection, K = 10240 in groups of 1280 for N = 4480, takes one group a program: its 1120
programs of 80 KB each were too few and too long to keep the memory busy): the programs write
float32 partials and the epilogue runs after their sum (one small XLA fusion).

Then the epilogue: y times the per-row weight scale (e4m3 weights, `fp8_linear`), rounded,
+ bias, the activation, `residual + scale * y`, each step rounded to x's dtype as the unfused
ops round it. So a decode layer's norm, GEMV, activation
and residual add are one kernel. Small tiles of N (`tiles`) keep each program short and the
grid many waves deep, so the last wave costs little. More than KERNEL_ROWS rows (prefill,
large batches) go to the xla reference, whose GEMMs are compute-bound there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from backends.fused import Norm
from backends.pallas._common import e4m3_value, interpret, triton_params
from backends.protocol import register
from backends.xla.linear import ACTIVATIONS, check_linear
from backends.xla.linear import linear as linear_reference

F32 = jnp.float32
MAX_ROWS = 8  # tokens the kernel can take (`linear_tiled`)
# tokens the op gives the kernel: at 8 rows its per-row reductions ran 4-20x slower than XLA's
# GEMM on an H200 (BENCHMARKS.md, "the fused projections"), so more than one goes to the reference
KERNEL_ROWS = 1


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


def _epilogue(acc, bias, res, dtype, act: str | None, scale: float, w_scale=None):
    """y (times `w_scale` when given) rounded, + bias, the activation, `res + scale * y`: each
    step rounded to `dtype` as the unfused ops round it (in the kernel, and after the sum of
    the split-K partials)."""
    if w_scale is not None:
        acc = acc * w_scale
    y = acc.astype(dtype).astype(F32)
    if bias is not None:
        y = (y + bias).astype(dtype).astype(F32)
    if act:
        y = _act(y, act).astype(dtype).astype(F32)
    if res is not None:
        y = res + (scale * y).astype(dtype).astype(F32)
    return y.astype(dtype)


def _kernel(
    x_ref,
    w_ref,
    *refs,
    m: int,
    k: int,
    n: int,
    bn: int,
    bk: int,
    splits: int,
    norm: str | None,
    eps: float,
    group: int,
    gate_offset: int,
    act: str | None,
    scale: float,
    has_bias: bool,
    has_res: bool,
    has_w_scale: bool,
    fp8_bits: bool = False,
):
    refs = list(refs)
    norm_w_ref = refs.pop(0) if norm else None
    gate_ref = refs.pop(0) if norm == "gated" else None
    w_scale_ref = refs.pop(0) if has_w_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if has_res else None
    (o_ref,) = refs
    dtype = x_ref.dtype
    cols = pl.program_id(0) * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    col_ok = cols < n
    part_k = k // splits  # this program's keys: [offset, offset + part_k)
    offset = pl.program_id(1) * part_k
    size = group if norm in ("gated", "group") else part_k  # a norm group (or all the keys)
    full, tail = size // bk, size % bk

    def chunk(start, end, carry):  # one [bn, bk] tile of w against every row of x
        parts, sums = carry  # `end`: the group's end, for the masks of its last (tail) chunk
        ks = start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        k_ok = None if end is None else ks < end
        ok = col_ok[:, None] & (True if end is None else k_ok[None, :])
        w = plgpu.load(w_ref.at[cols[:, None], ks[None, :]], mask=ok, other=0)
        w = e4m3_value(w) if fp8_bits else w.astype(F32)  # e4m3 rows come as their bytes
        if norm:
            nw = _load(norm_w_ref.at[ks], k_ok).astype(F32)
        parts, sums = list(parts), list(sums)
        for r in range(m):
            x = _load(x_ref.at[r, ks], k_ok).astype(F32)
            if norm == "gated":
                z = _load(gate_ref.at[r, gate_offset + ks], k_ok).astype(F32)
                x = x * (z / (1.0 + jnp.exp(-z)))
            if norm:
                sums[r] = sums[r] + jnp.sum(x * x)
                x = x * nw
            parts[r] = parts[r] + jnp.sum(w * x[None, :], axis=1)
        return parts, sums

    accs = [jnp.zeros((bn,), F32) for _ in range(m)]
    for g in range(part_k // size):  # norm groups (one without a group norm)
        base = offset + g * size
        carry = ([jnp.zeros((bn,), F32)] * m, [jnp.zeros((), F32)] * m)
        body = lambda i, c, b=base: chunk(b + i * bk, None, c)  # noqa: E731
        carry = jax.lax.fori_loop(0, full, body, carry)
        if tail:
            carry = chunk(base + full * bk, base + size, carry)
        parts, sums = carry
        for r in range(m):
            part = parts[r] * jax.lax.rsqrt(sums[r] / size + eps) if norm else parts[r]
            accs[r] = accs[r] + part
    if splits > 1:  # float32 partials; the epilogue follows their sum
        for r in range(m):
            plgpu.store(o_ref.at[pl.program_id(1), r, cols], accs[r], mask=col_ok)
        return
    b = plgpu.load(bias_ref.at[cols], mask=col_ok, other=0).astype(F32) if has_bias else None
    ws = plgpu.load(w_scale_ref.at[cols], mask=col_ok, other=0) if has_w_scale else None
    for r in range(m):
        res = None
        if has_res:
            res = plgpu.load(res_ref.at[r, cols], mask=col_ok, other=0).astype(F32)
        y = _epilogue(accs[r], b, res, dtype, act, scale, ws)
        plgpu.store(o_ref.at[r, cols], y.astype(o_ref.dtype), mask=col_ok)


def tiles(m: int, n: int, k: int, group: int = 0) -> tuple[int, int, int, int | None, int]:
    """(bn, bk, num_warps, num_stages, splits) for M rows of x times an [N, K] weight
    (measured on an H200: BENCHMARKS.md, "the fused projections" and "the copy timed back to
    back"). Up to 8192 keys, 2048 a chunk (Nano-9B-v2's 4480: 3 chunks, not 5); past that
    1024. num_stages None: Triton's default."""
    if group and group % 1024:  # Mamba2's output (groups of 1280): a group a program
        return 4, 2048, 4, None, k // group
    if group:
        return 8, 1024, 4, None, 1
    if k <= 8192:
        return 4, 2048, 4, None, 1
    return 4, 1024, 4, None, 1


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
    if m > KERNEL_ROWS or m == 0:
        return linear_reference(x, w, bias, norm, activation, residual, scale)
    n, k = w.shape
    group = 0 if norm is None else norm.group_size if norm.group_size != k else 0
    bn, bk, warps, stages, splits = tiles(m, n, k, group)
    return linear_tiled(
        x,
        w,
        bias,
        norm,
        activation,
        residual,
        scale,
        bn=bn,
        bk=bk,
        warps=warps,
        stages=stages,
        splits=splits,
    )


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
    splits: int = 1,
    w_scale: jax.Array | None = None,
) -> jax.Array:
    """`linear` with explicit tiles (`bn` output rows and `bk` of K per step, powers of two;
    a group's last chunk is masked where bk does not divide it) and `splits` programs along K
    (each K / splits keys, whole norm groups; float32 partials, summed before the epilogue);
    the benchmark sweeps them. `w_scale` float32 [N]: e4m3 rows `w`, each output times its
    scale before the epilogue (`fp8_linear`)."""
    check_linear(x, w, bias, norm, activation, residual)
    *lead, k = x.shape
    n = w.shape[0]
    m = x.size // k
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"the kernel takes 1 to {MAX_ROWS} rows of x, got {m}")
    gated = norm is not None and norm.gate is not None
    grouped = norm is not None and norm.group_size not in (0, k)
    group = (norm.group_size or k) if gated or grouped else 0
    if splits < 1 or k % splits or (norm is not None and (k // splits) % (group or k)):
        what = f"groups of {group or k}" if norm is not None else "keys"
        raise ValueError(f"{splits} splits of K = {k} must each hold whole {what}")
    fp8_bits = w.dtype == jnp.float8_e4m3fn  # read as bytes: Triton has no masked e4m3 load
    args = [x.reshape(m, k), jax.lax.bitcast_convert_type(w, jnp.uint8) if fp8_bits else w]
    if norm is not None:
        args.append(norm.weight)
        if gated:
            args.append(norm.gate.reshape(m, norm.gate.shape[-1]))
    if w_scale is not None:
        args.append(jnp.broadcast_to(w_scale.astype(F32), (n,)))
    if bias is not None:
        args.append(bias)
    if residual is not None:
        args.append(residual.reshape(m, n))
    kernel = functools.partial(
        _kernel,
        m=m,
        k=k,
        n=n,
        bn=bn,
        bk=bk,
        norm=None if norm is None else ("gated" if gated else "group" if grouped else "rms"),
        eps=0.0 if norm is None else float(norm.eps),
        group=group,
        gate_offset=norm.gate_offset if gated else 0,
        fp8_bits=fp8_bits,
        splits=splits,
        act=activation,
        scale=float(scale),
        has_bias=bias is not None,
        has_res=residual is not None,
        has_w_scale=w_scale is not None,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(
            (splits, m, n) if splits > 1 else (m, n), F32 if splits > 1 else x.dtype
        ),
        grid=(pl.cdiv(n, bn), splits),
        interpret=interpret(),
        compiler_params=triton_params(num_warps=warps, num_stages=stages),
        name="linear",
    )(*args)
    if splits > 1:
        res = None if residual is None else residual.reshape(m, n).astype(F32)
        b = None if bias is None else bias.astype(F32)
        ws = None if w_scale is None else w_scale.astype(F32)
        out = _epilogue(jnp.sum(out, axis=0), b, res, x.dtype, activation, float(scale), ws)
    return out.reshape(*lead, n)


__all__ = ["ACTIVATIONS", "linear", "linear_tiled", "tiles"]
