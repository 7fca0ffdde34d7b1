"""`mamba2_step_paged` as gather, step, scatter: the reference for states that live in a region.

The rows of the region that hold each state are gathered (a state need not start or end on a
row), bitcast to float32, updated by a backend's own `mamba2_step`, and scattered back whole,
the bytes around the state unchanged. Rows on the null page are dropped from the scatter, so
every index written is unique. `through(step)` builds the op from any backend's `mamba2_step`
(the torch backend reuses it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from backends.protocol import register
from backends.xla.ssd import mamba2_step

WORD = jnp.int32


def state_rows(state_offset: int, state_words: int, width: int) -> tuple[int, int]:
    """The rows [first, last) of a page that hold words [state_offset, + state_words)."""
    return state_offset // width, -(-(state_offset + state_words) // width)


def through(step: Callable) -> Callable:
    """`mamba2_step_paged` from a `mamba2_step` (gather the rows, step, scatter them back)."""

    def paged(
        region: jax.Array,
        pages: jax.Array,
        fresh: jax.Array,
        x: jax.Array,
        dt: jax.Array,
        a: jax.Array,
        b: jax.Array,
        c: jax.Array,
        d: jax.Array,
        state_offset: int,
        page_rows: int,
    ) -> tuple[jax.Array, jax.Array]:
        bsz, nh, p = x.shape
        ns = b.shape[-1]
        _, total, width = region.shape
        words = nh * p * ns
        first, last = state_rows(state_offset, words, width)
        span = jnp.arange(first, last, dtype=pages.dtype)[None, :]
        rows = pages[:, None] * page_rows + span  # [B, n]
        raw = region.at[0, rows].get(mode="promise_in_bounds").reshape(bsz, -1)
        lo = state_offset - first * width
        state = jax.lax.bitcast_convert_type(raw[:, lo : lo + words], jnp.float32)
        state = jnp.where(fresh[:, None] != 0, 0.0, state).reshape(bsz, nh, p, ns)
        y, new = step(state, x, dt, a, b, c, d)
        new_words = jax.lax.bitcast_convert_type(new.astype(jnp.float32), WORD)
        out = jnp.concatenate(
            [raw[:, :lo], new_words.reshape(bsz, words), raw[:, lo + words :]], axis=1
        )
        # the null page's rows (padding) go past the end, each to its own row, and are dropped
        beyond = total + jnp.arange(bsz, dtype=pages.dtype)[:, None] * (last - first) + span
        dst = jnp.where((pages > 0)[:, None], rows, beyond)
        region = region.at[0, dst].set(
            out.reshape(bsz, -1, width), mode="drop", unique_indices=True
        )
        return y, region

    return paged


mamba2_step_paged = register("mamba2_step_paged", "xla")(through(mamba2_step))
