"""RMSNorm and gated group RMSNorm in torch (float32 statistics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from backends.protocol import register
from backends.torch.bridge import call


@register("rms_norm", "torch")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    def fn(xt: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        x32 = xt.float()
        normed = x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)
        return wt * normed.to(xt.dtype)

    out = jax.ShapeDtypeStruct(x.shape, jnp.result_type(x.dtype, weight.dtype))
    return call(fn, out, x, weight)


@register("gated_rms_norm", "torch")
def gated_rms_norm(
    y: jax.Array, z: jax.Array, weight: jax.Array, eps: float, group_size: int
) -> jax.Array:
    def fn(yt: torch.Tensor, zt: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        g = yt.float() * F.silu(zt.float())
        grouped = g.reshape(*g.shape[:-1], g.shape[-1] // group_size, group_size)
        grouped = grouped * torch.rsqrt((grouped * grouped).mean(-1, keepdim=True) + eps)
        return wt * grouped.reshape(g.shape).to(yt.dtype)

    out = jax.ShapeDtypeStruct(y.shape, jnp.result_type(y.dtype, weight.dtype))
    return call(fn, out, y, z, weight)
