"""Einsum projections whose kernels carry logical axis names.

A projection is loaded as the checkpoint lays it out (`kernel [K..., N...]`: contracted axes
first). At tensor parallelism 1 the runner turns it into rows (`Einsum.to_rows`): the kernel as
`w [N, K]`, one row per output feature, and the projection then runs through the backend's
`linear` op, which can take the norm before it and the activation and residual add after it
(`backends.fused.Linear`): a decode layer's GEMV reads w row by row, with its neighbours fused.

An FP8 projection (`to_fp8`, from a ModelOpt checkpoint) keeps its kernel in e4m3 with a float32
`weight_scale` and a static `input_scale` (`backends.fp8`): `y = (q(x, s_x) W_q) * s_w`, through
the backend's `fp8_linear` op once stored as rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from backends import fp8
from backends.fused import Norm
from backends.protocol import Ops


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
        self.weight_scale: nnx.Param | None = nnx.data(None)  # `to_fp8`
        self.input_scale: nnx.Param | None = nnx.data(None)
        self.ops: Ops | None = None  # set by `to_rows`

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def to_fp8(self) -> None:
        """Store the kernel in e4m3 with a per-tensor `weight_scale` (amax / 448 of the current
        kernel) and an `input_scale` of 1 (an FP8 checkpoint's values replace all three when
        it is loaded). Before `to_rows`; idempotent."""
        if self.is_fp8:
            return
        if self.rows:
            raise ValueError("to_fp8 comes before to_rows")
        kernel = self.kernel[...]
        axes = self.kernel.get_metadata().get("axes")
        scale = fp8.tensor_scale(kernel)
        self.kernel = nnx.Param(fp8.quantize(kernel, scale), axes=axes)
        self.weight_scale = nnx.Param(scale, axes=())
        self.input_scale = nnx.Param(jnp.ones((), jnp.float32), axes=())

    @property
    def rows(self) -> bool:
        """Is the kernel stored as rows `[N, K]` (`to_rows`)?"""
        return self.ops is not None

    def _split(self) -> tuple[str, str, str, int]:
        """(x spec, kernel spec, out spec, number of contracted axes)."""
        lhs, out = self.equation.split("->")
        x_spec, k_spec = lhs.split(",")
        contracted = sum(1 for c in k_spec if c in x_spec and c not in out)
        return x_spec, k_spec, out, contracted

    def to_rows(self, ops: Ops) -> None:
        """Store the kernel as `w [N, K]` and run through `ops.linear` from now on (TP 1 only:
        the rows carry no sharding). Needs the contracted axes first in the kernel and last in
        x, in the same order (every projection of the models here). Idempotent."""
        if self.rows:
            return
        x_spec, k_spec, out, n_in = self._split()
        if not (x_spec.endswith(k_spec[:n_in]) and out.endswith(k_spec[n_in:])):
            raise ValueError(f"{self.equation}: contracted axes must lead the kernel, end x")
        kernel = self.kernel[...]
        k = math.prod(kernel.shape[:n_in])
        self.out_shape = tuple(kernel.shape[n_in:])
        self.in_axes = n_in
        self.kernel = nnx.Param(transposed(kernel.reshape(k, -1)), axes=(None, None))
        if self.bias is not None:
            self.bias = nnx.Param(self.bias[...].reshape(-1), axes=(None,))
        self.ops = ops

    def __call__(
        self,
        x: jax.Array,
        norm: Norm | None = None,
        activation: str | None = None,
        residual: jax.Array | None = None,
        scale: float = 1.0,
    ) -> jax.Array:
        """The projection of x; with rows (`to_rows`) also the `linear` op's norm before it
        and activation and `residual + scale * y` after it (`residual` flattened like y)."""
        bias = None if self.bias is None else self.bias[...]
        if not self.rows:
            if norm is not None or activation is not None or residual is not None:
                raise ValueError("a fused projection needs rows (Einsum.to_rows)")
            y = self._einsum(x)
            return y if bias is None else y + bias
        lead = x.shape[: x.ndim - self.in_axes]
        flat = x.reshape(*lead, -1)
        if residual is not None:
            residual = residual.reshape(*lead, -1)
        if self.is_fp8:
            scales = (self.weight_scale[...], self.input_scale[...])
            y = self.ops.fp8_linear(
                flat, self.kernel[...], *scales, bias, norm, activation, residual, scale
            )
        else:
            y = self.ops.linear(flat, self.kernel[...], bias, norm, activation, residual, scale)
        return y.reshape(*lead, *self.out_shape)

    def _einsum(self, x: jax.Array) -> jax.Array:
        """The projection by `equation` (the FP8 pattern of `backends.fp8` for e4m3 kernels)."""
        if not self.is_fp8:
            return jnp.einsum(self.equation, x, self.kernel[...])
        scales = (self.weight_scale[...], self.input_scale[...])
        return fp8.fp8_einsum(self.equation, x, self.kernel[...], *scales).astype(x.dtype)


@jax.jit
def transposed(kernel: jax.Array) -> jax.Array:
    """[K, N] -> [N, K] (one program per shape, reused by every layer of a model)."""
    return kernel.T
