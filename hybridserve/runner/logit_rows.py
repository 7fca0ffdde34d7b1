"""The sampled rows' logits, gathered from a step's programs (decode and packed prefill) into
one array in the order the requests sample."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.runner.input_batch import bucket


@functools.partial(jax.jit, static_argnames=("squeeze",))
def _take_rows(sources: list[jax.Array], rows: jax.Array, squeeze: bool) -> jax.Array:
    picked = jnp.concatenate(sources, axis=0)[rows]
    return picked[:, 0] if squeeze else picked


def gather_rows(
    got: dict[str, tuple[int, int]], order: list[str], sources: list[jax.Array], squeeze: bool
) -> jax.Array | None:
    """The rows of `order` from the programs' logits, padded to a power of two (the padding
    repeats the first row), so that a few shapes serve every batch; `squeeze` drops axis 1
    (one logit per row) in the same program."""
    if not order:
        return None
    offsets = np.cumsum([0] + [s.shape[0] for s in sources])
    rows = np.zeros(bucket(len(order)), np.int32)
    rows[: len(order)] = [offsets[got[r][0]] + got[r][1] for r in order]
    rows[len(order) :] = rows[0]
    return _take_rows(sources, jnp.asarray(rows), squeeze)
