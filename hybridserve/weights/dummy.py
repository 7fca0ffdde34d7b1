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
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cache

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

STD = 0.02


def _kind(name: str, ndim: int) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log", "dt_bias", "D"):
        return leaf
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
    if kind == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if kind == "dt_bias":
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # softplus^-1(dt)
    return (STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


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
