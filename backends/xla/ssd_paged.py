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


def read_words(
    region: jax.Array, pages: jax.Array, page_rows: int, offset: int, words: int
) -> tuple[jax.Array, jax.Array, int]:
    """The region rows of each page that hold its words [offset, offset + words): (those
    rows' words [B, n * Wd], the rows [B, n], the first of the words inside them)."""
    width = region.shape[2]
    first, last = state_rows(offset, words, width)
    rows = pages[:, None] * page_rows + jnp.arange(first, last, dtype=pages.dtype)[None, :]
    raw = region.at[0, rows].get(mode="promise_in_bounds").reshape(pages.shape[0], -1)
    return raw, rows, offset - first * width


def write_words(
    region: jax.Array, pages: jax.Array, rows: jax.Array, raw: jax.Array, lo: int, new: jax.Array
) -> jax.Array:
    """Inverse of `read_words`: `new` [B, words] stored from word `lo` of the rows it read
    (`raw`), the words around it as they were. The null page's rows (padding) go past the
    end, each to its own row, and are dropped, so every index is unique."""
    bsz, count = rows.shape
    _, total, width = region.shape
    out = jnp.concatenate([raw[:, :lo], new, raw[:, lo + new.shape[1] :]], axis=1)
    beyond = total + jnp.arange(bsz * count, dtype=pages.dtype).reshape(bsz, count)
    dst = jnp.where((pages > 0)[:, None], rows, beyond)
    return region.at[0, dst].set(out.reshape(bsz, count, width), mode="drop", unique_indices=True)


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
        words = nh * p * ns
        raw, rows, lo = read_words(region, pages, page_rows, state_offset, words)
        state = jax.lax.bitcast_convert_type(raw[:, lo : lo + words], jnp.float32)
        state = jnp.where(fresh[:, None] != 0, 0.0, state).reshape(bsz, nh, p, ns)
        y, new = step(state, x, dt, a, b, c, d)
        new_words = jax.lax.bitcast_convert_type(new.astype(jnp.float32), WORD)
        region = write_words(region, pages, rows, raw, lo, new_words.reshape(bsz, words))
        return y, region

    return paged


mamba2_step_paged = register("mamba2_step_paged", "xla")(through(mamba2_step))
