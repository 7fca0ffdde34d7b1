"""RMSNorm and gated group RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from backends.protocol import register


@register("rms_norm", "xla")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


@register("gated_rms_norm", "xla")
def gated_rms_norm(
    y: jax.Array, z: jax.Array, weight: jax.Array, eps: float, group_size: int
) -> jax.Array:
    g = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    grouped = g.reshape(*g.shape[:-1], g.shape[-1] // group_size, group_size)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    return weight * grouped.reshape(g.shape).astype(y.dtype)
