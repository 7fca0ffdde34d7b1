"""Grouped (ragged) matmul for mixture-of-experts layers."""

from __future__ import annotations

import jax

from backends.protocol import register


@register("grouped_matmul", "xla")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes.astype("int32"))
