"""Helpers shared by the Pallas kernels: interpret-mode choice, padding to powers of two, and
the in-kernel matmul."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

ENV_INTERPRET = "HYBRIDSERVE_PALLAS_INTERPRET"


def interpret() -> bool:
    """Run kernels in interpret mode? From the env var when set, else on CPU only.

    Read when an op is traced: a function jax has already traced keeps its choice."""
    flag = os.environ.get(ENV_INTERPRET, "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag in ("0", "false", "no", "off"):
        return False
    return jax.default_backend() == "cpu"


def triton_params(num_warps: int | None = None, num_stages: int | None = None):
    """Compiler params that select the Triton lowering on GPU (jax otherwise picks Mosaic GPU);
    ignored in interpret mode."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_axis(v: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `v` along `axis` up to `size` (no copy when it already has that size)."""
    extra = size - v.shape[axis]
    if extra == 0:
        return v
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, extra)
    return jnp.pad(v, widths)


def dot(lhs: jax.Array, rhs: jax.Array, lhs_contract: int = 1, rhs_contract: int = 0) -> jax.Array:
    """2-D matmul inside a kernel contracting the given axes, float32 accumulation. Float32
    operands multiply in full float32 (HIGHEST: no TF32); bf16 operands use the tensor cores."""
    f32 = jnp.float32 in (lhs.dtype, rhs.dtype)
    return jax.lax.dot_general(
        lhs,
        rhs,
        (((lhs_contract,), (rhs_contract,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST if f32 else None,
        preferred_element_type=jnp.float32,
    )


def e4m3_value(bits: jax.Array) -> jax.Array:
    """float32 value of float8_e4m3fn bit patterns (NaN, 0x7f / 0xff, never occurs: quantised
    values are clipped to 448), by building the float32 bits (no float8 loads in the kernel)."""
    bits = bits.astype(jnp.int32)
    exp, man = (bits >> 3) & 15, bits & 7
    normal = jax.lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
    value = jnp.where(exp == 0, man.astype(jnp.float32) * (2.0**-9), normal)
    return jnp.where(bits >= 128, -value, value)
