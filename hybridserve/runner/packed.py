"""Packed prefill: a step's prompt chunks cut into rows of one segment length.

A prefill program is [rows, S]: every chunk is cut into segments of S tokens (its last one may
be shorter), each segment one row, so a step costs about its real tokens instead of
rows x longest chunk. Rows of one chunk follow each other; `continues[i]` says row i goes on
from row i - 1 (the same sequence). Attention and the per-token layers need nothing more (a
segment's keys are written to the pages before any row attends); the recurrent layers carry
their state from row to row (`layers.mamba2_chain`).

S is chosen per step from a short ladder (the cap, and 16 * 4^k below it: few programs to
compile): the largest whose padded total (`bucket_rows(segments) * S`) stays within
10% of the real tokens, or else the one that pads least, among those that keep the rows within
`row_limit` (each row carries a recurrent state) and the slots within `token_limit`.
The row count is bucketed finer than powers of two past 8 rows (four steps an octave), so the
padding of a full step stays small.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hybridserve.cache.plan import CachePlan
from hybridserve.core.outputs import ScheduledChunk
from hybridserve.runner.input_batch import BatchArrays, bucket, build_batch

SMALLEST_SEGMENT = 16
MAX_SEGMENT = 256  # the default cap (rows of 256 tokens: whole tiles for the prefill kernels)
FEW_ROWS = 64  # rows any step may take (`row_limit`)
PADDING_GOAL = 1.1  # padded / real tokens that a larger segment may cost


def bucket_rows(n: int) -> int:
    """n rounded up to a power of two up to 8 rows (few programs for small steps), then four
    steps an octave: 1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (the smallest
    multiple of p / 4 that is >= n, p the largest power of two below n)."""
    if n <= 8:
        return bucket(n)
    step = bucket(n) // 8  # p / 4, with p = bucket(n) / 2
    return -(-n // step) * step


def segment_rows(lengths: list[int], size: int) -> int:
    """Rows that chunks of `lengths` tokens take in segments of `size`."""
    return sum(-(-n // size) for n in lengths)


def ladder(cap: int) -> list[int]:
    """The segment lengths a step may use, largest first: the cap (rounded up to a power of
    two >= 16) and 16 * 4^k below it."""
    top = bucket(cap, SMALLEST_SEGMENT)
    sizes, size = [top], SMALLEST_SEGMENT
    while size < top:
        sizes.append(size)
        size *= 4
    return sorted(set(sizes), reverse=True)


def row_limit(lengths: list[int], cap: int) -> int:
    """The most rows a step of chunks of `lengths` may take: twice what the longest segment
    needs at most (a partial row per chunk besides the whole ones), or `FEW_ROWS`. Every row
    carries its own recurrent state through the Mamba layers (several [rows, heads, P, N]
    float32 arrays a layer: 5 MB a row for the 9B shape), so short segments may not multiply
    the rows."""
    whole = -(-sum(lengths) // ladder(cap)[0])
    return max(FEW_ROWS, 2 * bucket_rows(len(lengths) + whole))


def token_limit(lengths: list[int], cap: int) -> int:
    """The most token slots (padding included) a step of chunks of `lengths` may take: twice
    its tokens, 20 a chunk and one segment more (rows of 16 always fit)."""
    return 2 * sum(lengths) + 20 * len(lengths) + ladder(cap)[0]


def segment_size(lengths: list[int], cap: int) -> int:
    """The segment length S for chunks of `lengths` tokens (see the module docstring)."""
    longest, rows, slots = max(lengths), row_limit(lengths, cap), token_limit(lengths, cap)
    sizes = [s for s in ladder(cap) if s < longest]
    sizes = [s for s in ladder(cap) if s >= longest][-1:] + sizes  # one that fits, if any
    padded = {s: bucket_rows(segment_rows(lengths, s)) * s for s in sizes}
    fit = [s for s in sizes if segment_rows(lengths, s) <= rows and padded[s] <= slots]
    if not fit:  # the fewest slots among the row-bounded (the longest segment always is)
        return min((s for s in sizes if segment_rows(lengths, s) <= rows), key=padded.get)
    allowed = max(PADDING_GOAL * sum(lengths), min(padded[s] for s in fit))
    return next(s for s in fit if padded[s] <= allowed)


def _piece(chunk: ScheduledChunk, at: int, size: int) -> ScheduledChunk:
    """Tokens [at, at + size) of `chunk` as a chunk of their own (samples only at its end)."""
    ids = chunk.token_ids[at : at + size]
    mm = None
    if chunk.mm is not None:
        offsets, values = chunk.mm
        keep = [k for k, o in enumerate(offsets) if at <= o < at + len(ids)]
        if keep:
            mm = (tuple(offsets[k] - at for k in keep), np.asarray(values)[keep])
    last = at + len(ids) == len(chunk.token_ids)
    return dataclasses.replace(
        chunk, token_ids=ids, start=chunk.start + at, sample=chunk.sample and last, mm=mm
    )


def build_packed(
    chunks: list[ScheduledChunk], plan: CachePlan, max_model_len: int, cap: int
) -> BatchArrays:
    """The packed batch of prompt chunks (no drafts): rows of S tokens, `owners` set (the
    chunk of each row) and `continues` where a row goes on from another (else None)."""
    if any(c.num_drafts for c in chunks):
        raise ValueError("packed prefill takes no draft tokens")
    size = segment_size([len(c.token_ids) for c in chunks], cap)
    pieces, owners, continues = [], [], []
    for i, chunk in enumerate(chunks):
        for j, at in enumerate(range(0, len(chunk.token_ids), size)):
            pieces.append(_piece(chunk, at, size))
            owners.append(i)
            continues.append(j > 0)
    rows = bucket_rows(len(pieces))
    batch = build_batch(pieces, plan, max_model_len, size, rows=rows)
    pad = rows - len(pieces)
    owners_padded = np.asarray(owners + [-1] * pad, np.int32)
    if not any(continues):  # every chunk in one row: the program without the Mamba chain
        return dataclasses.replace(batch, owners=owners_padded)
    return dataclasses.replace(
        batch, continues=np.asarray(continues + [False] * pad, np.int32), owners=owners_padded
    )


def packed_shapes(max_tokens: int, max_num_seqs: int, cap: int) -> list[tuple[int, int]]:
    """(rows, S) of every packed program for steps of at most `max_tokens` prompt tokens over
    at most `max_num_seqs` chunks, segments up to `cap`: within the step's `row_limit` and
    `token_limit` at their largest (a step that no S fits within both takes the fewest slots
    within its rows, possibly a program outside these: compiled when met)."""
    top = ladder(cap)[0]
    most_rows = max(FEW_ROWS, 2 * bucket_rows(max_num_seqs + -(-max_tokens // top)))
    most_slots = 2 * max_tokens + 20 * max_num_seqs + top
    out = []
    for size in ladder(cap):
        most = min(most_rows, bucket_rows(-(-max_tokens // size) + max_num_seqs))
        rows = 1
        while rows * size <= most_slots or rows == 1:
            out.append((rows, size))
            if rows >= most:
                break
            rows = bucket_rows(rows + 1)
    return out
