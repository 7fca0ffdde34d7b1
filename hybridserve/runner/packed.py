"""Packed prefill: a step's prompt chunks cut into rows of one segment length.

A prefill program is [rows, S]: every chunk is cut into segments of S tokens (its last one may
be shorter), each segment one row, so a step costs about its real tokens instead of
rows x longest chunk. Rows of one chunk follow each other; `continues[i]` says row i goes on
from row i - 1 (the same sequence). Attention and the per-token layers need nothing more (a
segment's keys are written to the pages before any row attends); the recurrent layers carry
their state from row to row (`layers.mamba2_chain`).

S is chosen per step from a short ladder (the cap, and 16 * 4^k below it: few programs to
compile): the largest whose padded total (`bucket_rows(segments) * S`) stays within
10% of the real tokens, or else the one that pads least, among those that keep a program
within its `PackLimits` (rows: each carries a recurrent state; token slots) and its slots
within `token_limit`. A step whose chunks fit no program (many short chunks) runs as several
(`split_chunks`). The row count is bucketed finer than powers of two past 8 rows (four steps
an octave), so the padding of a full step stays small.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hybridserve.cache.plan import CachePlan
from hybridserve.core.outputs import ScheduledChunk
from hybridserve.runner.input_batch import BatchArrays, bucket, build_batch

SMALLEST_SEGMENT = 16
MAX_SEGMENT = 512  # the default cap: a 512-token chunk in one row beat two rows of 256 (BENCHMARKS)
FEW_ROWS = 64  # rows any program may take (more when a step's whole segments need them)
PADDING_GOAL = 1.1  # padded / real tokens that a larger segment may cost


@dataclasses.dataclass(frozen=True)
class PackLimits:
    """What one packed program may hold: segments of at most `segment` tokens, at most `rows`
    rows and `slots` token slots (padding included). These bound a program's activations
    (each row carries a recurrent state through the Mamba layers: several [rows, heads, P, N]
    float32 arrays a layer, 5 MB a row for the 9B shape; each slot its token's activations), so
    the memory profile (`runner.memory`) compiles at most these. A step whose chunks need more
    runs as several programs (`split_chunks`)."""

    segment: int
    rows: int
    slots: int

    @classmethod
    def for_steps(cls, step_tokens: int, segment: int) -> PackLimits:
        """Limits for steps of at most `step_tokens` prompt tokens: a full step in rows of the
        longest segment fits one program, and so do `FEW_ROWS` rows of the shortest."""
        top = ladder(segment)[0]
        whole = bucket_rows(-(-step_tokens // top))
        return cls(segment, max(FEW_ROWS, whole), max(whole * top, FEW_ROWS * SMALLEST_SEGMENT))


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


def token_limit(lengths: list[int], limits: PackLimits) -> int:
    """The most token slots (padding included) chunks of `lengths` may take in one program:
    twice their tokens, 20 a chunk and one segment more (rows of 16 always fit), within
    `limits.slots`."""
    loose = 2 * sum(lengths) + 20 * len(lengths) + ladder(limits.segment)[0]
    return min(loose, limits.slots)


def _fitting(lengths: list[int], limits: PackLimits) -> tuple[list[int], dict[int, int]]:
    """The segment lengths that may pack `lengths` (one that holds the longest chunk in a
    row, if any, then the shorter ones), and the ones among them within the limits, with their
    padded slots."""
    longest = max(lengths)
    sizes = [s for s in ladder(limits.segment) if s < longest]
    sizes = [s for s in ladder(limits.segment) if s >= longest][-1:] + sizes
    slots = token_limit(lengths, limits)
    padded = {s: bucket_rows(segment_rows(lengths, s)) * s for s in sizes}
    fit = {
        s: n for s, n in padded.items() if n <= slots and segment_rows(lengths, s) <= limits.rows
    }
    return sizes, fit


def fits(lengths: list[int], limits: PackLimits) -> bool:
    """Chunks of `lengths` tokens fit one program within `limits`."""
    return bool(_fitting(lengths, limits)[1])


def segment_size(lengths: list[int], limits: PackLimits) -> int:
    """The segment length S for chunks of `lengths` tokens (see the module docstring). Chunks
    that fit no S within the limits (more than a step's tokens) take the longest segment."""
    sizes, fit = _fitting(lengths, limits)
    if not fit:
        return sizes[0] if sizes[0] >= max(lengths) else ladder(limits.segment)[0]
    allowed = max(PADDING_GOAL * sum(lengths), min(fit.values()))
    return next(s for s in sizes if s in fit and fit[s] <= allowed)


def split_chunks(chunks: list[ScheduledChunk], limits: PackLimits) -> list[list[ScheduledChunk]]:
    """`chunks` in order, cut into consecutive groups that each fit one program within
    `limits`, each group taking chunks while they fit: one group for most steps, several when
    the chunks' partial rows need more rows or slots (many short chunks; 27 chunks of 300
    tokens take 54 rows of 256, 14336 slots, against 32 x 256 for 8192 tokens)."""
    if fits([len(c.token_ids) for c in chunks], limits):
        return [list(chunks)]
    groups: list[list[ScheduledChunk]] = []
    for chunk in chunks:
        grown = groups[-1] + [chunk] if groups else []
        if grown and fits([len(c.token_ids) for c in grown], limits):
            groups[-1] = grown
        else:
            groups.append([chunk])
    return groups


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
    chunks: list[ScheduledChunk], plan: CachePlan, max_model_len: int, limits: PackLimits
) -> BatchArrays:
    """The packed batch of prompt chunks (no drafts; one group of `split_chunks`): rows of S
    tokens, `owners` set (the chunk of each row) and `continues` (1 where a row goes on from
    the row before)."""
    if any(c.num_drafts for c in chunks):
        raise ValueError("packed prefill takes no draft tokens")
    size = segment_size([len(c.token_ids) for c in chunks], limits)
    pieces, owners, continues = [], [], []
    for i, chunk in enumerate(chunks):
        for j, at in enumerate(range(0, len(chunk.token_ids), size)):
            pieces.append(_piece(chunk, at, size))
            owners.append(i)
            continues.append(j > 0)
    rows = bucket_rows(len(pieces))
    batch = build_batch(pieces, plan, max_model_len, size, rows=rows)
    pad = rows - len(pieces)
    # always with `continues`, all zeros when every chunk fits one row: one program a shape
    # (a form without the chain would save its matmul a layer but compile twice; a program of
    # one row skips the chain by its shape)
    return dataclasses.replace(
        batch,
        continues=np.asarray(continues + [False] * pad, np.int32),
        owners=np.asarray(owners + [-1] * pad, np.int32),
    )


def packed_shapes(max_tokens: int, max_num_seqs: int, limits: PackLimits) -> list[tuple[int, int]]:
    """(rows, S) of every packed program for steps of at most `max_tokens` prompt tokens over
    at most `max_num_seqs` chunks, within `limits` (a chunk longer than `max_tokens` may take
    a program outside these: compiled when met)."""
    out = []
    for size in ladder(limits.segment):
        most = min(limits.rows, bucket_rows(-(-max_tokens // size) + max_num_seqs))
        rows = 1
        while rows * size <= limits.slots or rows == 1:
            out.append((rows, size))
            if rows >= most:
                break
            rows = bucket_rows(rows + 1)
    return out
