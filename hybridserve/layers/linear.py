"""Einsum projections whose kernels carry logical axis names."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype: jnp.dtype,
    fan_in: int | None = None,
    init: str = "normal",
) -> nnx.Param:
    """A parameter with logical `axes`. `init`: "normal" (std 1/sqrt(fan_in)), "ones", "zeros".

    Real weights are loaded from checkpoints; the initialisers only make random models for tests.
    """
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        std = 1.0 / math.sqrt(fan_in or shape[0])
        key = rngs.params() if rngs is not None else jax.random.key(0)
        value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=axes)


class Einsum(nnx.Module):
    """`y = einsum(equation, x, kernel) (+ bias)`; the equation documents the shapes.

    Example: `Einsum("btd,dnh->btnh", (D, N, H), ("embed", "heads", None), ...)`.
    """

    def __init__(
        self,
        equation: str,
        kernel_shape: tuple[int, ...],
        axes: tuple[str | None, ...],
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
        bias: bool = False,
    ) -> None:
        self.equation = equation
        lhs, out = equation.split("->")
        x_spec, k_spec = lhs.split(",")
        contracted = [i for i, c in enumerate(k_spec) if c in x_spec and c not in out]
        fan_in = math.prod(kernel_shape[i] for i in contracted) if contracted else None
        self.kernel = param(rngs, kernel_shape, axes, dtype, fan_in=fan_in)
        if bias:
            kept = [i for i, c in enumerate(k_spec) if c in out]
            self.bias = param(
                rngs,
                tuple(kernel_shape[i] for i in kept),
                tuple(axes[i] for i in kept),
                dtype,
                init="zeros",
            )
        else:
            self.bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum(self.equation, x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y
