"""FP8 ops of the pallas backend.

`fp8_linear`: for one token (decode at batch 1, where the step reads every weight once) the
input's norm and e4m3 rounding in one XLA fusion, then the Pallas GEMV (`linear_tiled`) over the
e4m3 rows, each output times its row's weight scale before the epilogue (bias, activation,
residual): the weights are read at one byte a value. More rows go to the reference (the pattern
XLA can lower to a cuBLASLt FP8 GEMM; `scripts/bench_fp8.py` checks).
`fp8_grouped_matmul` is in `moe.py` (the grouped-matmul kernel over e4m3 bytes).
"""

from __future__ import annotations

import jax

from backends import fp8
from backends.fused import Norm
from backends.pallas.linear import KERNEL_ROWS, linear_tiled, tiles
from backends.protocol import register
from backends.xla import fp8 as xla_fp8
from backends.xla.linear import check_linear, normed
from backends.xla.norm import gated_rms_norm, rms_norm

reference = xla_fp8.through_fp8(rms_norm, gated_rms_norm)


@register("fp8_linear", "pallas")
def fp8_linear(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    x_scale: jax.Array | None,
    bias: jax.Array | None = None,
    norm: Norm | None = None,
    activation: str | None = None,
    residual: jax.Array | None = None,
    scale: float = 1.0,
) -> jax.Array:
    m = x.size // max(x.shape[-1], 1)
    if m > KERNEL_ROWS or m == 0:
        return reference(x, w, w_scale, x_scale, bias, norm, activation, residual, scale)
    check_linear(x, w, bias, norm, activation, residual)
    xla_fp8.check_scales(w, w_scale, x_scale, 0)
    h = normed(x, norm, rms_norm, gated_rms_norm)
    if x_scale is not None:
        h = fp8.fake_quantize(h, x_scale)
    n, k = w.shape
    bn, bk, warps, stages, splits = tiles(m, n, k)
    return linear_tiled(
        h, w, bias, None, activation, residual, scale,
        bn=bn, bk=bk, warps=warps, stages=stages, splits=splits, w_scale=w_scale,
    )  # fmt: skip
