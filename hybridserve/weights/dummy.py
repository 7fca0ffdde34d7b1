"""Random weights for a model that has only a config (`load_format="dummy"`, as in vLLM).

For benchmarks at sizes no checkpoint here has: every parameter is drawn on its devices,
already sharded, from a seed, so two processes with the same seed and config (a prefill and a
decode worker) hold the same model without a file between them. The draws follow the Hugging
Face initialisation of these families (`initializer_range` 0.02):

    matrices, embeddings, conv taps:  w ~ N(0, 0.02^2)
    norm weights, D:                  1
    biases:                           0
    A_log:                            log(U(1, 16))         (A = -exp(A_log) in [-16, -1])
    dt_bias:                          softplus^-1(exp(U(log 1e-3, log 1e-1)))

so that dt = softplus(dt_bias) starts in [1e-3, 0.1], as the Mamba2 initialisation does.
FP8 parameters (`ModelConfig.quant`) hold the same N(0, 0.02^2) weights as e4m3 codes under
`weight_scale` = 4 * 0.02 / 448 (a 4-sigma value maps to the largest code); `input_scale` is
16 / 448 (inputs up to 16 in magnitude keep their precision) and the KV scales are 1.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cache

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from backends import fp8

STD = 0.02
FP8_WEIGHT_SCALE = 4 * STD / 448
FP8_INPUT_SCALE = 16 / 448


def _kind(name: str, ndim: int) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log", "dt_bias", "D", "weight_scale", "input_scale"):
        return leaf
    if leaf in ("k_scale", "v_scale"):
        return "ones"
    if "bias" in name:
        return "zeros"
    if ndim == 1 and ("norm" in name or leaf in ("weight", "scale")):
        return "ones"
    return "normal"


def _draw(kind: str, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    if kind == "ones" or kind == "D":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    if kind in ("weight_scale", "input_scale"):
        value = FP8_WEIGHT_SCALE if kind == "weight_scale" else FP8_INPUT_SCALE
        return jnp.full(shape, value, dtype)
    if kind == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if kind == "dt_bias":
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # softplus^-1(dt)
    w = STD * jax.random.normal(key, shape, jnp.float32)
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        return fp8.quantize(w, FP8_WEIGHT_SCALE)
    return w.astype(dtype)


@cache
def _program(
    kind: str, shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding
) -> Callable[[jax.Array], jax.Array]:
    """One compiled program per (kind, shape, dtype, sharding): layers repeat their shapes."""
    return jax.jit(lambda key: _draw(kind, key, shape, dtype), out_shardings=sharding)


def dummy_array(
    name: str, shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding, seed: int = 0
) -> jax.Array:
    """The parameter `name` (dotted path) drawn as the module docstring says, placed with
    `sharding`; the same (name, seed) always gives the same values."""
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return _program(_kind(name, len(shape)), tuple(shape), jnp.dtype(dtype), sharding)(key)
