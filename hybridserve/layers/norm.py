"""RMSNorm (the op lives in the backend)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops
from hybridserve.layers.linear import param


class RMSNorm(nnx.Module):
    """`y = weight * x / sqrt(mean(x^2) + eps)`, statistics in float32."""

    def __init__(self, dim: int, eps: float, ops: Ops, *, dtype: jnp.dtype) -> None:
        self.weight = param(None, (dim,), ("embed",), dtype, init="ones")
        self.eps = eps
        self.ops = ops

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.ops.rms_norm(x, self.weight[...], self.eps)
