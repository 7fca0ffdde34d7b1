"""Helpers shared by the Pallas kernels: interpret-mode choice and padding to powers of two."""

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
