"""FP8 (e4m3) with per-tensor scales: the weights of an NVIDIA ModelOpt "FP8" checkpoint, the
activations its static `input_scale`s quantise, and the FP8 KV cache.

A real value v and its code q (float8_e4m3fn: 4 exponent bits, 3 mantissa bits, largest
finite 448, no infinities) under a float32 scale s:

  quantize:    q = e4m3(clip(v / s, -448, 448))     (round to nearest even)
  dequantize:  v' = float(q) * s

so |v' - v| <= 2^-4 |v| for |v| / s in the normal range [2^-6, 448] (half a step of a 3-bit
mantissa), and <= 2^-10 s below it (subnormal steps of 2^-9 s). The clip matters: a plain cast
of a value past 448 gives NaN (e4m3fn has no infinity).

W8A8 projection (`fp8_matmul`): `y = (dq(q(x, s_x)) @ dq(w_q, 1)^T) * s_w`, i.e. the input
fake-quantised with its static scale and the e4m3 weight rows multiplied, then the per-row
weight scale: the pattern (converts and scalar multiplies around a dot) that XLA's GEMM
rewriter can turn into a cuBLASLt FP8 GEMM on sm89+ GPUs (`scripts/bench_fp8.py` checks the
compiled program); elsewhere it is computed as written.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from backends.fused import Norm

Array = jax.Array

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
F32 = jnp.float32


def is_float8(dtype: object) -> bool:
    """Is `dtype` (a name or a dtype) one of the 8-bit float formats?"""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def quantize(x: jax.Array, scale: jax.Array | float, dtype: object = E4M3) -> jax.Array:
    """Codes of `x / scale` in the 8-bit float `dtype` (e4m3 unless given), clipped to its
    finite range (float32 inside)."""
    top = float(jnp.finfo(dtype).max)
    v = x.astype(F32) / jnp.asarray(scale, F32)
    return jnp.clip(v, -top, top).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array | float, dtype: jnp.dtype) -> jax.Array:
    """`float(q) * scale` in `dtype` (the product in float32)."""
    return (q.astype(F32) * jnp.asarray(scale, F32)).astype(dtype)


def fake_quantize(x: jax.Array, scale: jax.Array | float) -> jax.Array:
    """x rounded through e4m3 under `scale` (what an FP8 GEMM sees), in x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def tensor_scale(w: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
    """The scale ModelOpt uses, `amax(|w|) / 448` (1 where all are zero): per tensor, or per
    slice when `axis` names the axes reduced (e.g. `(1, 2)`: one per expert of [E, K, N])."""
    amax = jnp.max(jnp.abs(w.astype(F32)), axis=axis)
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(F32)


def fp8_einsum(
    equation: str, x: jax.Array, w: jax.Array, w_scale: jax.Array, x_scale: jax.Array | None
) -> jax.Array:
    """`einsum(equation, q(x, x_scale), w) * w_scale` with e4m3 weights `w` widened to x's
    dtype, float32 accumulation: the W8A8 pattern (module docstring). `w_scale` broadcasts
    against the output; `x_scale` None: no input rounding. Returns float32."""
    h = x if x_scale is None else fake_quantize(x, x_scale)
    y = jnp.einsum(equation, h, w.astype(x.dtype), preferred_element_type=F32)
    return y * w_scale.astype(F32)


def fp8_matmul(
    x: jax.Array, w: jax.Array, w_scale: jax.Array, x_scale: jax.Array | None
) -> jax.Array:
    """`x [..., K] @ (w [N, K] * w_scale)^T` with e4m3 rows `w` (`fp8_einsum`).

    `w_scale`: [] (per tensor) or [N] (per row: merged projections of different tensors);
    `x_scale`: the static input scale ([]), or None for weight-only (no input rounding).
    Returns [..., N] float32.

    On a GPU with an input scale both operands go into the dot as e4m3 (cuBLASLt's FP8 GEMM:
    1.64x the bf16 GEMM on an H100 at 8192 x 4480 -> 15680, where the dequantise pattern, which
    XLA did not rewrite, ran at 0.85x; `scripts/bench_fp8.py`), the scales applied to the
    float32 product; elsewhere the dequantise pattern (`fp8_einsum`)."""
    if x_scale is None or jax.default_backend() != "gpu":
        return fp8_einsum("...k,nk->...n", x, w, w_scale, x_scale)
    q = quantize(x, x_scale)
    dims = (((q.ndim - 1,), (1,)), ((), ()))
    # HIGHEST: XLA then keeps cuBLASLt's FP8 accumulation exact (DEFAULT asks for its "fast
    # accumulation", which measured 2.5% relative error at K = 4480 on an H100)
    y = jax.lax.dot_general(
        q, w, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32
    )
    return y * (jnp.asarray(x_scale, F32) * w_scale.astype(F32))


class Fp8Linear(Protocol):
    def __call__(
        self,
        x: Array,
        w: Array,
        w_scale: Array,
        x_scale: Array | None,
        bias: Array | None = None,
        norm: Norm | None = None,
        activation: str | None = None,
        residual: Array | None = None,
        scale: float = 1.0,
    ) -> Array:
        """`linear` over e4m3 weight rows (`backends.fp8`, W8A8 with static scales):
          `out = residual + scale * act((q(norm(x), x_scale) w^T) * w_scale + bias)`
        with `q` the input rounded through e4m3 under its scale (none when x_scale is None),
        float32 accumulation, the projection rounded to x's dtype before the epilogue.

        Args: x [..., K]; w float8_e4m3fn [N, K]; w_scale float32 [] or [N] (per row);
          x_scale float32 [] or None; the rest as `linear`.
        Returns: [..., N] in x's dtype.
        """


class Fp8GroupedMatmul(Protocol):
    def __call__(
        self,
        x: Array,
        w: Array,
        w_scale: Array,
        x_scale: Array | None,
        group_sizes: Array,
    ) -> Array:
        """`grouped_matmul` with e4m3 expert weights and per-expert scales: row r of expert e
        gives `(q(x_r, x_scale[e]) @ w[e]) * w_scale[e]` (`q` as in `fp8_linear`).

        Args: x [M, K]; w float8_e4m3fn [E, K, N]; w_scale float32 [E]; x_scale float32 [E] or
          None; group_sizes [E] int32 summing to at most M.
        Returns: [M, N] in x's dtype (rows past sum(group_sizes) are zero).
        """
