"""Host-side (numpy) assembly of one forward call's inputs from scheduled chunks.

Rows and tokens per row are bucketed to powers of two, and block tables always span
`max_model_len`, so that a small set of programs is compiled (at warmup) and reused; padding
rows have no tokens and point at the null page 0.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hybridserve.cache.plan import CachePlan
from hybridserve.core.outputs import ScheduledChunk


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power-of-two multiple of `smallest` that is >= n."""
    size = smallest
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass(frozen=True)
class BatchArrays:
    """Numpy inputs of one forward call (rows already padded)."""

    tokens: np.ndarray  # [B, T] int32
    positions: np.ndarray  # [B, T] int32
    lengths: np.ndarray  # [B] int32
    tables: tuple[np.ndarray, ...]  # per group: [B, nblk] kernel blocks, or [B] state pages
    num_rows: int  # real rows (the rest is padding)
    embeds: np.ndarray | None = None  # [B, T, D] float32 multimodal rows, or None
    embed_mask: np.ndarray | None = None  # [B, T] bool: where `embeds` replace tokens
    num_drafts: np.ndarray | None = None  # [B] int32 draft tokens at the end of each row
    continues: np.ndarray | None = None  # [B] int32: packed prefill, row goes on from row - 1
    owners: np.ndarray | None = None  # [B] int32: the chunk of each row (-1: padding)

    def chunk_rows(self) -> np.ndarray:
        """[B] int32: the chunk each row computes (-1 for padding rows)."""
        if self.owners is not None:
            return self.owners
        rows = np.full(self.tokens.shape[0], -1, np.int32)
        rows[: self.num_rows] = np.arange(self.num_rows)
        return rows

    def last_rows(self) -> np.ndarray:
        """[chunks] int32: the row that holds each chunk's last token."""
        owners = self.chunk_rows()
        n = int(owners.max()) + 1
        last = np.zeros(n, np.int32)
        real = np.flatnonzero(owners >= 0)
        np.maximum.at(last, owners[real], real.astype(np.int32))
        return last


def table_width(plan: CachePlan, max_model_len: int) -> int:
    """Kernel blocks in every block table row: enough for `max_model_len` tokens."""
    return -(-max_model_len // plan.kernel_block_size)


def token_buckets(largest: int, smallest: int = 16) -> list[int]:
    """The tokens-per-row buckets of prefill programs."""
    sizes = [smallest]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


def build_batch(
    chunks: list[ScheduledChunk],
    plan: CachePlan,
    max_model_len: int,
    min_tokens: int = 1,
    rows: int | None = None,
) -> BatchArrays:
    """Pad `chunks` into one batch of `rows` rows (default: a power of two); attention pages
    expand to kernel blocks `L*ratio + j`."""
    n = len(chunks)
    rows = bucket(n) if rows is None else rows
    t = bucket(max(len(c.token_ids) for c in chunks), min_tokens)
    ratio = plan.ratio
    nblk = table_width(plan, max_model_len)
    tokens = np.zeros((rows, t), np.int32)
    lengths = np.zeros(rows, np.int32)
    starts = np.zeros(rows, np.int32)
    for i, c in enumerate(chunks):
        tokens[i, : len(c.token_ids)] = c.token_ids
        lengths[i] = len(c.token_ids)
        starts[i] = c.start
    tables = []
    for g, group in enumerate(plan.groups):
        if not group.spec.holds_tokens:  # one state page per row
            pages = np.zeros(rows, np.int32)
            for i, c in enumerate(chunks):
                pages[i] = c.block_tables[g][0]
            tables.append(pages)
        else:
            kernel = np.zeros((rows, nblk), np.int32)
            for i, c in enumerate(chunks):
                logical = np.asarray(c.block_tables[g], np.int64)
                ids = (logical[:, None] * ratio + np.arange(ratio)[None, :]).reshape(-1)
                kernel[i, : min(len(ids), nblk)] = ids[:nblk]
            tables.append(kernel)
    positions = starts[:, None] + np.arange(t, dtype=np.int32)[None, :]
    embeds = mask = None
    if any(c.mm is not None for c in chunks):
        width = next(np.shape(c.mm[1])[1] for c in chunks if c.mm is not None)
        embeds, mask = np.zeros((rows, t, width), np.float32), np.zeros((rows, t), bool)
        for i, c in enumerate(chunks):
            if c.mm is not None:
                offsets, values = c.mm
                embeds[i, list(offsets)] = np.asarray(values, np.float32)
                mask[i, list(offsets)] = True
    drafts = np.zeros(rows, np.int32)
    drafts[:n] = [c.num_drafts for c in chunks]
    return BatchArrays(tokens, positions, lengths, tuple(tables), n, embeds, mask, drafts)


def pack_ints(arrays: list[np.ndarray]) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
    """Integer step inputs -> one flat int32 vector and their shapes, so that a step makes one
    host-to-device copy (each copy costs a dispatch, and a new buffer address that the GPU
    program's command buffer must be updated for)."""
    flat = np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in arrays])
    return flat, tuple(tuple(a.shape) for a in arrays)


def unpack_ints(flat: jax.Array, shapes: tuple[tuple[int, ...], ...]) -> list[jax.Array]:
    """Inverse of `pack_ints` (inside the jitted step; the shapes are static)."""
    out, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(flat[at : at + n].reshape(shape))
        at += n
    return out
