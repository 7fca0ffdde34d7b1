"""`linear`: the norm, the projection, bias, activation and residual add as the unfused ops
compute them (XLA fuses what it can around its GEMM)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from backends.fused import Norm
from backends.protocol import register
from backends.xla.norm import gated_rms_norm, rms_norm

ACTIVATIONS = (None, "relu2", "silu")


def check_linear(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None,
    norm: Norm | None,
    activation: str | None,
    residual: jax.Array | None,
) -> None:
    """ValueError when the shapes or options of a `linear` call do not fit together."""
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x {x.shape} does not contract with w [N, K] {w.shape}")
    n, k = w.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias {bias.shape} must be [{n}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation {activation!r} is not one of {ACTIVATIONS}")
    if residual is not None and residual.shape != (*x.shape[:-1], n):
        raise ValueError(f"linear: residual {residual.shape} must be {(*x.shape[:-1], n)}")
    if norm is None:
        return
    if norm.weight.shape != (k,):
        raise ValueError(f"linear: norm weight {norm.weight.shape} must be [{k}]")
    group = norm.group_size or k
    if k % group:
        raise ValueError(f"linear: norm groups of {group} do not divide K = {k}")
    if norm.gate is not None:
        if norm.gate.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"linear: gate {norm.gate.shape} does not fit x {x.shape}")
        if not 0 <= norm.gate_offset <= norm.gate.shape[-1] - k:
            raise ValueError(f"linear: gate offset {norm.gate_offset} + {k} past the gate")


def _activate(y: jax.Array, name: str | None) -> jax.Array:
    if name == "relu2":
        return jnp.square(jax.nn.relu(y))
    if name == "silu":
        return jax.nn.silu(y)
    return y


def _group_rms(x: jax.Array, weight: jax.Array, eps: float, group: int) -> jax.Array:
    """RMSNorm per group of `group` channels (as `rms_norm` rounds it)."""
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, group)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.reshape(x.shape).astype(x.dtype)


def normed(x: jax.Array, norm: Norm | None, rms: Callable, gated: Callable) -> jax.Array:
    """`linear`'s input after its norm (x itself without one), in x's dtype."""
    if norm is None:
        return x
    if norm.gate is None and norm.group_size not in (0, x.shape[-1]):
        return _group_rms(x, norm.weight, norm.eps, norm.group_size).astype(x.dtype)
    if norm.gate is None:
        return rms(x, norm.weight, norm.eps).astype(x.dtype)
    z = norm.gate[..., norm.gate_offset : norm.gate_offset + x.shape[-1]]
    return gated(x, z, norm.weight, norm.eps, norm.group_size or x.shape[-1]).astype(x.dtype)


def finish(
    y: jax.Array,
    bias: jax.Array | None,
    activation: str | None,
    residual: jax.Array | None,
    scale: float,
    dtype: jnp.dtype,
) -> jax.Array:
    """`linear`'s epilogue on the projection y: `residual + scale * act(y + bias)` in `dtype`
    (y rounded to `dtype` first, as the unfused ops round it)."""
    y = y.astype(dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    y = _activate(y, activation)
    if residual is not None:
        y = residual + scale * y
    return y.astype(dtype)


def through(rms: Callable, gated: Callable) -> Callable:
    """`linear` from a backend's `rms_norm` and `gated_rms_norm` (the torch backend reuses
    it), the projection and the rest in plain jax."""

    def linear(
        x: jax.Array,
        w: jax.Array,
        bias: jax.Array | None = None,
        norm: Norm | None = None,
        activation: str | None = None,
        residual: jax.Array | None = None,
        scale: float = 1.0,
    ) -> jax.Array:
        check_linear(x, w, bias, norm, activation, residual)
        h = normed(x, norm, rms, gated)
        y = jnp.einsum("...k,nk->...n", h, w.astype(x.dtype))
        return finish(y, bias, activation, residual, scale, x.dtype)

    return linear


linear = register("linear", "xla")(through(rms_norm, gated_rms_norm))
