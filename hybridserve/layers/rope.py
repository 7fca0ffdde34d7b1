"""Rotary position embedding on the first `rotary_dim` channels (non-interleaved halves)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int) -> jax.Array:
    """Rotate channel pairs (i, i + rotary_dim/2) of x by `position * theta^(-2i/rotary_dim)`.

    Args: x [B, T, heads, H]; positions [B, T] int. Returns x's shape and dtype.
    """
    half = rotary_dim // 2
    inv_freq = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    rot, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
