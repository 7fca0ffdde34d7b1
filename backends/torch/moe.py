"""Grouped (ragged) matmul for mixture-of-experts layers, one torch matmul per expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from backends import nvfp4
from backends.protocol import register
from backends.torch.bridge import call


@register("grouped_matmul", "torch")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    out_dtype = jnp.result_type(x.dtype, w.dtype)

    def fn(xt, wt, st):
        out = torch.zeros(xt.shape[0], wt.shape[2], dtype=torch.float32, device=xt.device)
        ends = torch.cumsum(st.long(), 0).tolist()
        start = 0
        for e, end in enumerate(ends):
            end = min(end, xt.shape[0])  # rows past sum(group_sizes) stay zero, as in ragged_dot
            if end > start:
                out[start:end] = xt[start:end].float() @ wt[e].float()
            start = max(start, end)
        return out

    return call(fn, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), out_dtype), x, w, group_sizes)


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes, from the magnitude table."""
    table = torch.tensor(nvfp4.MAGNITUDES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where(code >= 8, -mag, mag)


@register("nvfp4_grouped_matmul", "torch")
def nvfp4_grouped_matmul(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    tensor_scale: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    # The scales cross as their e4m3 bit patterns (numpy has no float8) and are read back in
    # torch's float8_e4m3fn.
    scale_bits = jax.lax.bitcast_convert_type(scales, jnp.uint8)

    def fn(xt, ct, st, tt):
        e, half, n = ct.shape
        planes = ct.reshape(e, half // 16, 1, 16, n)
        code = torch.cat([planes & 15, planes >> 4], dim=2).reshape(e, 2 * half, n)
        scale = st.view(torch.float8_e4m3fn).float().repeat_interleave(nvfp4.GROUP, dim=1)
        return (_e2m1(code) * scale * tt[:, None, None]).to(xt.dtype)

    e, half, n = codes.shape
    spec = jax.ShapeDtypeStruct((e, 2 * half, n), x.dtype)
    w = call(fn, spec, x, codes, scale_bits, tensor_scale)
    return grouped_matmul(x, w, group_sizes).astype(x.dtype)
