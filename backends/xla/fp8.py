"""FP8 projections and expert matmuls (`backends.fp8`: e4m3 weights, per-tensor scales): the
references, written as the dequantise-and-multiply pattern that XLA can lower to FP8 GEMMs on
sm89+ GPUs (`scripts/bench_fp8.py` checks whether it does) and computes as written on the
CPU."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from backends import fp8
from backends.fused import Norm
from backends.protocol import register
from backends.xla.linear import check_linear, finish, normed
from backends.xla.norm import gated_rms_norm, rms_norm


def check_scales(w: jax.Array, w_scale: jax.Array, x_scale: jax.Array | None, lead: int) -> None:
    """ValueError unless `w` is e4m3 and the scales fit its `lead` leading (expert) axes."""
    if w.dtype != fp8.E4M3:
        raise ValueError(f"fp8 weights must be float8_e4m3fn, got {w.dtype}")
    if lead == 0 and w_scale.shape not in ((), (w.shape[0],)):
        raise ValueError(f"w_scale {w_scale.shape} must be [] or [N] = [{w.shape[0]}]")
    if lead and w_scale.shape != w.shape[:lead]:
        raise ValueError(f"w_scale {w_scale.shape} must be {w.shape[:lead]} (one per expert)")
    if x_scale is not None and x_scale.shape != w.shape[:lead]:
        raise ValueError(f"x_scale {x_scale.shape} must be {w.shape[:lead]}")


def through_fp8(rms: Callable, gated: Callable) -> Callable:
    """`fp8_linear` from a backend's norms and the reference FP8 matmul."""

    def fp8_linear(
        x: jax.Array,
        w: jax.Array,
        w_scale: jax.Array,
        x_scale: jax.Array | None,
        bias: jax.Array | None = None,
        norm: Norm | None = None,
        activation: str | None = None,
        residual: jax.Array | None = None,
        scale: float = 1.0,
    ) -> jax.Array:
        check_linear(x, w, bias, norm, activation, residual)
        check_scales(w, w_scale, x_scale, 0)
        y = fp8.fp8_matmul(normed(x, norm, rms, gated), w, w_scale, x_scale)
        return finish(y, bias, activation, residual, scale, x.dtype)

    return fp8_linear


fp8_linear = register("fp8_linear", "xla")(through_fp8(rms_norm, gated_rms_norm))


@register("fp8_grouped_matmul", "xla")
def fp8_grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    x_scale: jax.Array | None,
    group_sizes: jax.Array,
) -> jax.Array:
    check_scales(w, w_scale, x_scale, 1)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    expert = jnp.minimum(
        jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right"), w.shape[0] - 1
    )
    h = x if x_scale is None else fp8.fake_quantize(x, x_scale[expert][:, None])
    y = jax.lax.ragged_dot(h, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    return (y * w_scale[expert][:, None]).astype(x.dtype)
