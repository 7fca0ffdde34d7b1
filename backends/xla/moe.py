"""Grouped (ragged) matmul for mixture-of-experts layers, also over NVFP4 weights (dequantise,
then multiply: the reference for the fused kernels)."""

from __future__ import annotations

import jax

from backends import nvfp4
from backends.protocol import register


@register("grouped_matmul", "xla")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes.astype("int32"))


@register("nvfp4_grouped_matmul", "xla")
def nvfp4_grouped_matmul(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    tensor_scale: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    w = nvfp4.dequantize(nvfp4.Nvfp4Weight(codes, scales, tensor_scale)).astype(x.dtype)
    return grouped_matmul(x, w, group_sizes).astype(x.dtype)
