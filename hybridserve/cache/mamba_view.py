"""Typed views of a Mamba layer's state pages (`cache.page_layout.MambaPage`) in its region.

A state page is `[x | B | C | ssm | pad]` (DS) or `[conv | ssm | pad]` (SD) from its first
row. Two ways to reach it:
- whole pages (`read_mamba` / `write_mamba`): one gather of the pages' rows, one scatter back
  (prefill, and any layout the in-place path does not take);
- the conv state alone (`read_conv` / `write_conv`, or per rank as one array of its x|B|C
  channels: `read_conv_ranks` / `write_conv_ranks`): the rows that hold `[0, conv_bytes)`; the
  ssm state then stays where it is for a backend's `mamba2_step_paged`, which updates it in
  place (`in_place`). The last conv row may hold the first ssm words: `write_conv` writes them
  back as `read_conv` found them, so it must run before the ssm update.
Every scatter writes whole rows; rows of the null page (0: padding) go past the end of the
region, each to its own row, and are dropped, so every index is unique (XLA's GPU scatter then
stores plainly, without a compare-and-swap per element) and the donated region is updated in
place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridserve.cache.view import (
    IN_BOUNDS,
    WORD_BYTES,
    MambaAccess,
    duplicate,
    merge_tp,
    pack_words,
    read_slab,
    split_tp,
    undup,
)


def in_place(acc: MambaAccess) -> bool:
    """Can the ssm state be updated where it lies (`mamba2_step_paged`)? A float32 state whose
    slab starts on a word, after a conv state of whole words."""
    return (
        jnp.dtype(acc.ssm_dtype) == jnp.float32
        and acc.page.conv_bytes % WORD_BYTES == 0
        and acc.page.ssm.offset % WORD_BYTES == 0
    )


def state_offset(acc: MambaAccess) -> int:
    """The ssm state's first word inside its page."""
    return acc.page.ssm.offset // WORD_BYTES


def _rows(pages: jax.Array, page_rows: int, count: int) -> jax.Array:
    """The first `count` region rows of pages `pages` ([B]): [B, count]."""
    return pages[:, None] * page_rows + jnp.arange(count, dtype=pages.dtype)[None, :]


def _gather(region: jax.Array, pages: jax.Array, page_rows: int, count: int) -> jax.Array:
    """The first `count` rows of pages `pages` as words [tp, B, count * row words]."""
    tp, _, width = region.shape
    rows = region.at[:, _rows(pages, page_rows, count)].get(mode=IN_BOUNDS)
    return rows.reshape(tp, pages.shape[0], count * width)


def _scatter(region: jax.Array, pages: jax.Array, page_rows: int, words: jax.Array) -> jax.Array:
    """Store words [tp, B, count * row words] over the first `count` rows of `pages`."""
    tp, total, width = region.shape
    count = words.shape[-1] // width
    beyond = total + _rows(jnp.arange(pages.shape[0], dtype=pages.dtype), count, count)
    dst = jnp.where((pages > 0)[:, None], _rows(pages, page_rows, count), beyond)
    rows = words.reshape(tp, -1, count, width)
    return region.at[:, dst].set(rows, mode="drop", unique_indices=True)


def _conv_from(raw: jax.Array, acc: MambaAccess, tp: int) -> tuple[jax.Array, ...]:
    """The conv states (x [B, X, W-1], B and C [B, G*N, W-1], global) from page words."""
    page = acc.page
    if acc.layout == "DS":
        parts = [
            read_slab(raw, s.offset, s.end, acc.conv_dtype, (dim, acc.rows))
            for s, dim in ((page.x, acc.x_dim), (page.b, acc.bc_dim), (page.c, acc.bc_dim))
        ]
    else:
        shape = (acc.rows, acc.x_dim + 2 * acc.bc_dim)
        conv = read_slab(raw, 0, page.conv_bytes, acc.conv_dtype, shape)
        splits = (acc.x_dim, acc.x_dim + acc.bc_dim)
        parts = [jnp.swapaxes(p, -1, -2) for p in jnp.split(conv, splits, axis=-1)]
    x, b, c = (merge_tp(p, 1) for p in parts)  # [B, channels, W-1]
    dup = acc.group_dup(tp)
    b, c = (
        undup(m.reshape(m.shape[0], -1, acc.state_size, acc.rows), 1, dup).reshape(
            m.shape[0], -1, acc.rows
        )
        for m in (b, c)
    )
    return x, b, c


def _conv_parts(
    acc: MambaAccess, tp: int, x: jax.Array, b: jax.Array, c: jax.Array
) -> list[tuple[jax.Array, str]]:
    """The conv states as per-rank parts in page order, for `pack_words`."""
    dup = acc.group_dup(tp)
    b, c = (
        duplicate(m.reshape(m.shape[0], -1, acc.state_size, acc.rows), 1, dup).reshape(
            m.shape[0], -1, acc.rows
        )
        for m in (b, c)
    )
    x, b, c = (split_tp(m, 1, tp) for m in (x, b, c))  # [tp, B, local, W-1]
    if acc.layout == "DS":  # the x, B, C slabs in page order
        return [(m, acc.conv_dtype) for m in (x, b, c)]
    # [0, conv_bytes): (rows, conv_local)
    rows_major = jnp.concatenate([jnp.swapaxes(m, -1, -2) for m in (x, b, c)], axis=-1)
    return [(rows_major, acc.conv_dtype)]


def read_mamba(
    region: jax.Array, acc: MambaAccess, tp: int, pages: jax.Array, page_rows: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(conv x [B, X, W-1], conv B [B, G*N, W-1], conv C, ssm [B, Hs, P, N]) of state pages,
    then `region` itself (unchanged), so a caller threads it on like `write_mamba`'s result."""
    raw = _gather(region, pages, page_rows, page_rows)  # [tp, B, page words]
    x, b, c = _conv_from(raw, acc, tp)
    ssm = read_slab(raw, acc.page.ssm.offset, acc.page.ssm.end, acc.ssm_dtype, acc.ssm_shape)
    return x, b, c, merge_tp(ssm, 1), region


def write_mamba(
    region: jax.Array,
    acc: MambaAccess,
    tp: int,
    pages: jax.Array,
    page_rows: int,
    x: jax.Array,
    b: jax.Array,
    c: jax.Array,
    ssm: jax.Array,
) -> jax.Array:
    """Inverse of `read_mamba`: store the four states into the state pages (whole pages: the
    slabs from byte 0, then zeros over the padding)."""
    tp, _, width = region.shape
    parts = [*_conv_parts(acc, tp, x, b, c), (split_tp(ssm, 1, tp), acc.ssm_dtype)]
    return _scatter(region, pages, page_rows, pack_words(parts, page_rows * width * WORD_BYTES))


def _conv_count(acc: MambaAccess, width: int) -> int:
    """How many rows of a page hold its conv state."""
    return -(-acc.page.conv_bytes // (width * WORD_BYTES))


def read_conv(
    region: jax.Array, acc: MambaAccess, tp: int, pages: jax.Array, page_rows: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(conv x, conv B, conv C, as `read_mamba`; the rows read, words [tp, B, n]: give them to
    `write_conv`). Needs `in_place(acc)`."""
    raw = _gather(region, pages, page_rows, _conv_count(acc, region.shape[2]))
    return (*_conv_from(raw, acc, tp), raw)


def write_conv(
    region: jax.Array,
    acc: MambaAccess,
    tp: int,
    pages: jax.Array,
    page_rows: int,
    x: jax.Array,
    b: jax.Array,
    c: jax.Array,
    raw: jax.Array,
) -> jax.Array:
    """Store the new conv states over the rows `read_conv` read (`raw`); the words of those rows
    past the conv state are written back unchanged."""
    conv_bytes = acc.page.conv_bytes
    words = pack_words(_conv_parts(acc, region.shape[0], x, b, c), conv_bytes)
    rows = jnp.concatenate([words, raw[..., conv_bytes // WORD_BYTES :]], axis=-1)
    return _scatter(region, pages, page_rows, rows)


def read_conv_ranks(
    region: jax.Array, acc: MambaAccess, pages: jax.Array, page_rows: int
) -> tuple[jax.Array, jax.Array]:
    """Each rank's conv state as one array [tp, B, X + 2 G*N, W-1] of its own x|B|C channels in
    page order (B and C groups as the rank holds them: split or duplicated), and the rows read
    (words [tp, B, n]: give them to `write_conv_ranks`). Needs `in_place(acc)`."""
    raw = _gather(region, pages, page_rows, _conv_count(acc, region.shape[2]))
    channels = acc.x_dim + 2 * acc.bc_dim
    if acc.layout == "DS":  # x, B, C slabs of [channels, W-1] back to back: one slab
        state = read_slab(raw, 0, acc.page.conv_bytes, acc.conv_dtype, (channels, acc.rows))
    else:
        rows = read_slab(raw, 0, acc.page.conv_bytes, acc.conv_dtype, (acc.rows, channels))
        state = jnp.swapaxes(rows, -1, -2)
    return state, raw


def write_conv_ranks(
    region: jax.Array,
    acc: MambaAccess,
    pages: jax.Array,
    page_rows: int,
    state: jax.Array,
    raw: jax.Array,
) -> jax.Array:
    """Inverse of `read_conv_ranks`: store `state` [tp, B, channels, W-1] over the rows it read
    (`raw`); the words of those rows past the conv state are written back unchanged."""
    conv_bytes = acc.page.conv_bytes
    part = state if acc.layout == "DS" else jnp.swapaxes(state, -1, -2)
    words = pack_words([(part, acc.conv_dtype)], conv_bytes)
    rows = jnp.concatenate([words, raw[..., conv_bytes // WORD_BYTES :]], axis=-1)
    return _scatter(region, pages, page_rows, rows)
