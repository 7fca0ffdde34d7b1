"""Typed views of the raw cache regions, at the offsets of `cache.page_layout`.

A region is one buffer of 32-bit words (`WORD`) `[tp, num_pages * page_rows, row_bytes / 4]`
(sharded over "tp" on axis 0: each rank owns the bytes of its own pages); page p is rows
`[p * page_rows, (p+1) * page_rows)` and a row is one head's K (or V) of one token
(`AttentionPage.row_bytes`). The buffer is never reshaped: XLA then updates it in place. Words,
not bytes: a float32 state is its words bitcast, with no size-changing conversion (which XLA
may materialise, and which a kernel reading the region in place cannot do), and 16-bit K/V are
two to a word. Every row is whole words (`build_layout` checks); a Mamba slab that does not
start and end on a word is read and written through its bytes.

Every layer reads and writes its cache through a typed view of its region: the attention view
and the Mamba view of one page are the same bytes. Where each byte lies (K/V halves, head-major
kernel pages, the x/B/C/ssm slabs, padding) is the page layout's (`AttentionPage`, `MambaPage`);
the views only read its rows and offsets.

Global arrays (what the model computes with) split their sharded axis as `[tp, local]`; heads or
groups fewer than tp are duplicated so that each rank holds one (`dup` copies of each).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from hybridserve.cache.page_layout import AttentionPage, MambaPage

# Page and row ids come from the scheduler and are always valid: promising it lets XLA update
# the (donated) regions in place instead of guarding, and copying, the whole buffer.
IN_BOUNDS = "promise_in_bounds"
WORD = jnp.int32  # the regions' element (int32: torch, which allocates shareable regions, has it)
WORD_BYTES = 4


@dataclasses.dataclass(frozen=True)
class AttentionAccess:
    """Where one attention layer's KV lives: its region, group and page layout (rank 0's: the
    offsets are the same on every rank)."""

    region: int
    group: int
    kv_heads: int  # global KV heads of the model
    page: AttentionPage
    dtype: str
    sliding_window: int | None = None

    @property
    def kv_heads_local(self) -> int:
        """Per rank, after duplication."""
        return self.page.heads_local

    @property
    def head_dim(self) -> int:
        return self.page.head_dim

    @property
    def kernel_block(self) -> int:
        return self.page.kernel_block

    def dup(self, tp: int) -> int:
        return self.kv_heads_local * tp // self.kv_heads


@dataclasses.dataclass(frozen=True)
class MambaAccess:
    """Where one Mamba layer's conv and ssm states live inside its state page (`page`)."""

    region: int
    group: int
    n_groups: int  # global B/C groups of the model
    page: MambaPage
    conv_dtype: str
    ssm_dtype: str

    @property
    def x_dim(self) -> int:  # local
        return self.page.x_dim

    @property
    def bc_dim(self) -> int:  # local
        return self.page.bc_dim

    @property
    def state_size(self) -> int:
        return self.page.state_size

    @property
    def rows(self) -> int:  # W - 1
        return self.page.conv_rows

    @property
    def ssm_shape(self) -> tuple[int, int, int]:  # local (heads, head_dim, state)
        return self.page.ssm_shape

    @property
    def layout(self) -> str:
        return self.page.layout

    def group_dup(self, tp: int) -> int:
        return self.bc_dim // self.state_size * tp // self.n_groups


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static cache facts for one engine: per-layer access (None for cacheless layers) and the
    device mesh the regions are sharded over (None: not known here; views that need a rank's
    own shard then take the global path)."""

    layers: tuple[AttentionAccess | MambaAccess | None, ...]
    tp: int
    ratio: int
    page_bytes: int
    row_bytes: int  # one head's K (or V) of one token; the whole page without attention
    mesh: Mesh | None = None

    @property
    def page_rows(self) -> int:
        return self.page_bytes // self.row_bytes


def split_tp(x: jax.Array, axis: int, tp: int) -> jax.Array:
    """Global -> per-rank: axis `axis` of size tp*n becomes n, with a new leading tp axis."""
    shape = list(x.shape)
    x = x.reshape(*shape[:axis], tp, shape[axis] // tp, *shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def merge_tp(x: jax.Array, axis: int) -> jax.Array:
    """Per-rank -> global: the leading tp axis merges into axis `axis` (of x without tp)."""
    x = jnp.moveaxis(x, 0, axis)
    shape = list(x.shape)
    return x.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :])


def to_raw(x: jax.Array, dtype: str, n_lead: int) -> jax.Array:
    """[tp, *lead, *shape] -> words [tp, *lead, nbytes / 4] (the values' bytes in order; their
    bytes must fill whole words). 32-bit values are their own words (a bitcast)."""
    typed = x.astype(dtype)
    lead = x.shape[: 1 + n_lead]
    size = jnp.dtype(dtype).itemsize
    if size >= WORD_BYTES:
        return jax.lax.bitcast_convert_type(typed, WORD).reshape(*lead, -1)
    packed = typed.reshape(*lead, -1, WORD_BYTES // size)
    return jax.lax.bitcast_convert_type(packed, WORD)


def from_raw(raw: jax.Array, dtype: str, shape: tuple[int, ...]) -> jax.Array:
    """Words [tp, *lead, nwords] -> [tp, *lead, *shape] of dtype (the inverse of `to_raw`)."""
    lead = raw.shape[:-1]
    size = jnp.dtype(dtype).itemsize
    if size > WORD_BYTES:
        raw = raw.reshape(*lead, -1, size // WORD_BYTES)
    return jax.lax.bitcast_convert_type(raw, jnp.dtype(dtype)).reshape(*lead, *shape)


def words_to_bytes(raw: jax.Array) -> jax.Array:
    """Words [..., n] -> uint8 [..., 4n] (little-endian: the bytes as they lie in memory)."""
    return jax.lax.bitcast_convert_type(raw, jnp.uint8).reshape(*raw.shape[:-1], -1)


def bytes_to_words(raw: jax.Array) -> jax.Array:
    """uint8 [..., 4n] -> words [..., n] (the inverse of `words_to_bytes`)."""
    return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, WORD_BYTES), WORD)


def read_slab(
    raw: jax.Array, start: int, end: int, dtype: str, shape: tuple[int, ...]
) -> jax.Array:
    """Bytes `[start, end)` of pages of words [tp, B, nwords] as values of `shape`: a slice of
    whole words when the slab is word-aligned, else through its bytes."""
    if start % WORD_BYTES == 0 and end % WORD_BYTES == 0:
        return from_raw(raw[..., start // WORD_BYTES : end // WORD_BYTES], dtype, shape)
    part = words_to_bytes(raw)[..., start:end]
    lead, size = part.shape[:-1], jnp.dtype(dtype).itemsize
    if size > 1:
        part = part.reshape(*lead, -1, size)
    return jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)).reshape(*lead, *shape)


def pack_words(parts: list[tuple[jax.Array, str]], page_bytes: int) -> jax.Array:
    """Values [tp, B, ...] (with their storage dtypes), in page order from byte 0, then zeros to
    `page_bytes`: words [tp, B, page_bytes / 4]. Whole words are concatenated as words; parts
    whose bytes do not fill words go through bytes."""
    sizes = [math.prod(x.shape[2:]) * jnp.dtype(d).itemsize for x, d in parts]
    if all(n % WORD_BYTES == 0 for n in sizes):
        words = [to_raw(x, d, 1) for x, d in parts]
        used = sum(sizes) // WORD_BYTES
        pad = page_bytes // WORD_BYTES - used
        out = jnp.concatenate(words, axis=-1)
        return jnp.pad(out, ((0, 0), (0, 0), (0, pad)))
    raw = [
        jax.lax.bitcast_convert_type(x.astype(d), jnp.uint8).reshape(*x.shape[:2], -1)
        for x, d in parts
    ]
    out = jnp.concatenate(raw, axis=-1)
    return bytes_to_words(jnp.pad(out, ((0, 0), (0, 0), (0, page_bytes - sum(sizes)))))


def duplicate(x: jax.Array, axis: int, dup: int) -> jax.Array:
    """Repeat each entry of `axis` `dup` times (heads/groups fewer than tp)."""
    return x if dup == 1 else jnp.repeat(x, dup, axis=axis)


def undup(x: jax.Array, axis: int, dup: int) -> jax.Array:
    """Keep the first of each run of `dup` duplicates along `axis`."""
    if dup == 1:
        return x
    shape = list(x.shape)
    x = x.reshape(*shape[:axis], shape[axis] // dup, dup, *shape[axis + 1 :])
    return jnp.take(x, 0, axis=axis + 1)


def apply_page_copies(
    regions: list[jax.Array], copies: jax.Array, page_rows: int
) -> list[jax.Array]:
    """Copy whole pages `copies[:, 0] -> copies[:, 1]` in every region (padding: 0 -> 0)."""
    span = jnp.arange(page_rows)[None, :]
    src, dst = copies[:, :1] * page_rows + span, copies[:, 1:] * page_rows + span
    return [r.at[:, dst].set(r.at[:, src].get(mode=IN_BOUNDS), mode=IN_BOUNDS) for r in regions]


def _kv_rows(
    acc: AttentionAccess, table: jax.Array, positions: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Rows [B, T, heads_local] of the K and V of tokens at `positions` (invalid: null page)."""
    page, kb = acc.page, acc.kernel_block
    idx = jnp.clip(positions // kb, 0, table.shape[1] - 1)
    kid = jnp.take_along_axis(table, idx, axis=1)[..., None]  # [B, T, 1]
    head = jnp.arange(page.heads_local)[None, None, :]
    slot = (positions % kb)[..., None]
    null = page.row(0, 0, head, 0)  # padding tokens: the null page's rows
    k_rows, v_rows = (
        jnp.where(valid[..., None], page.row(kid, kv, head, slot), null) for kv in (0, 1)
    )
    return k_rows, v_rows


def write_kv(
    region: jax.Array,
    acc: AttentionAccess,
    tp: int,
    table: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    k: jax.Array,
    v: jax.Array,
) -> jax.Array:
    """Write new tokens' K and V ([B, T, K, H]) at their positions through the block table
    ([B, nblk] kernel block ids); padding tokens go to the null page's rows."""
    dup = acc.dup(tp)
    for rows, val in zip(_kv_rows(acc, table, positions, valid), (k, v), strict=True):
        per_rank = split_tp(duplicate(val, 2, dup), 2, tp)  # [tp, B, T, heads_local, H]
        region = region.at[:, rows].set(to_raw(per_rank, acc.dtype, 3), mode=IN_BOUNDS)
    return region


def read_kv(
    region: jax.Array,
    acc: AttentionAccess,
    tp: int,
    table: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The K and V ([B, T, K, H]) of the tokens at `positions`, gathered through the block table
    (zeros where `valid` is false): the inverse of `write_kv`."""
    out = []
    for rows in _kv_rows(acc, table, positions, valid):
        raw = region.at[:, rows].get(mode=IN_BOUNDS)  # [tp, B, T, heads_local, row_bytes]
        typed = undup(merge_tp(from_raw(raw, acc.dtype, (acc.head_dim,)), 2), 2, acc.dup(tp))
        out.append(jnp.where(valid[..., None, None], typed, 0))
    return out[0], out[1]


def kv_pages(region: jax.Array, acc: AttentionAccess, tp: int) -> tuple[jax.Array, jax.Array]:
    """The whole region as typed K and V pages `[kernel blocks, K, kb, H]` each (the layout
    `paged_attention` reads; a view: no page is gathered here). With tp > 1 the rank axis moves
    next to the heads, which XLA laid out by copying every shard (seen on CPU at TP 2): a step
    should read one rank's shard with `kv_pages_local` instead."""
    typed = from_raw(region, acc.dtype, (acc.head_dim,))  # [tp, rows, H]
    typed = typed.reshape(tp, -1, *acc.page.kernel_page_shape)  # [tp, blocks, K|V, heads, kb, H]
    full = undup(merge_tp(typed, 2), 2, acc.dup(tp))  # [blocks, K|V, K, kb, H]
    return full[:, 0], full[:, 1]


def kv_pages_local(shard: jax.Array, acc: AttentionAccess) -> jax.Array:
    """One rank's shard of a region ([1, rows, words]: inside `shard_map`, or the region at
    TP 1) as its joint K|V pages `[kernel blocks, 2, heads_local, kb, H]` (`paged_attention`'s
    joint form): a bitcast and a reshape of its own bytes, with duplicated heads kept (rank r
    holds global KV head (r * heads_local + j) // dup)."""
    typed = from_raw(shard, acc.dtype, (acc.head_dim,))  # [1, rows, H]
    return typed.reshape(-1, *acc.page.kernel_page_shape)  # [blocks, K|V, heads_local, kb, H]
