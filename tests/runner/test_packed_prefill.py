"""Packed prefill (`runner.packed`, `layers.mamba2_chain`): prompt chunks cut into rows of S
tokens compute what one row per chunk computes (the unpacked reference: rows x longest chunk),
on the shipped default model (Mamba2, attention and MoE layers), float32."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridserve.core.outputs import ScheduledChunk, SchedulerOutput
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.runner.factory import make_runner
from hybridserve.runner.input_batch import build_batch
from hybridserve.runner.packed import (
    PackLimits,
    bucket_rows,
    build_packed,
    fits,
    ladder,
    packed_shapes,
    segment_rows,
    segment_size,
    split_chunks,
    token_limit,
)

TOL = dict(rtol=2e-4, atol=2e-4)  # float32; the joined scan rounds in another order


def test_row_buckets_and_the_segment_ladder():
    assert [bucket_rows(n) for n in range(1, 14)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10, 12, 12, 14]
    assert [bucket_rows(n) for n in (17, 33, 65, 129, 300)] == [20, 40, 80, 160, 320]
    assert ladder(256) == [256, 64, 16] and ladder(32) == [32, 16] and ladder(10) == [16]
    big = PackLimits.for_steps(8192, 256)  # a step of 8192 tokens in rows of 256: 32 rows
    assert big == PackLimits(256, 64, 8192)
    # one long chunk: the cap; a long and two short ones: 20 rows of 16 pad 1.08x (6 of 64:
    # 1.3x, 3 of 256: 2.6x)
    assert segment_size([1024], big) == 256
    assert segment_size([256, 20, 20], big) == 16
    # rows of 16 would pad least (2560 slots) but take 148 rows, over 64; rows of 256 take 36
    # (40 bucketed: 10240 slots), over the slots (twice the 2000 tokens + 20 a chunk + 256);
    # rows of 64 take 52 (56: 3584 slots)
    lengths = [20] * 30 + [1400]
    assert token_limit(lengths, big) == 4876
    assert segment_size(lengths, big) == 64
    # over random steps of <= 8192 tokens and <= 256 chunks, each group of `split_chunks`
    # fits one program within the limits, among the warmed shapes, and takes all the chunks
    # that fit (27 chunks of 300 tokens take 54 rows of 256, 14336 slots, or 135 of 64: two
    # programs); the groups keep the order
    rng = np.random.default_rng(0)
    shapes = set(packed_shapes(8192, 256, big))
    assert max(r for r, _ in shapes) <= 64 and max(r * s for r, s in shapes) <= 8192
    for _ in range(300):
        lengths = rng.integers(1, int(rng.choice([4, 40, 300, 2048])) + 1, 256)
        lengths = lengths[np.cumsum(lengths) <= 8192].tolist() or [1]
        chunks = [_chunk(str(i), [1] * n, 0, ((1,),)) for i, n in enumerate(lengths)]
        groups = split_chunks(chunks, big)
        assert [c for g in groups for c in g] == chunks
        for group, after in zip(groups, groups[1:], strict=False):
            assert not fits([len(c.token_ids) for c in group + after[:1]], big)
        for group in groups:
            sizes = [len(c.token_ids) for c in group]
            size = segment_size(sizes, big)
            rows = bucket_rows(segment_rows(sizes, size))
            assert rows <= 64 and rows * size <= 8192 and (rows, size) in shapes
    assert segment_size([5], big) == 16 and segment_size([60], big) == 64
    assert segment_size([40], big) == 64  # 3 rows of 16 bucket to 4: the slots of one of 64
    assert segment_size([40, 40, 40], big) == 16  # 9 rows of 16 (10 slots) against 3 of 64
    for lengths in ([1000, 24, 300], [7, 9, 13], [256] * 8, [129, 1, 1]):
        size = segment_size(lengths, big)
        padded = bucket_rows(segment_rows(lengths, size)) * size
        best = min(bucket_rows(segment_rows(lengths, s)) * s for s in ladder(256))
        assert padded <= max(1.1 * sum(lengths), best)
    # a chunk longer than a step (no program within the limits) takes the longest segment
    assert segment_size([20000], big) == 256


def _chunk(req: str, ids: list[int], start: int, tables) -> ScheduledChunk:
    return ScheduledChunk(req, tuple(ids), start, tables, True)


def test_build_packed_cuts_chunks_into_rows():
    runner = _runner()
    tables = runner.scratch_tables(80)
    chunks = [_chunk("a", list(range(1, 41)), 8, tables), _chunk("b", [5] * 3, 0, tables)]
    small = PackLimits.for_steps(64, 16)
    batch = build_packed(chunks, runner.plan, runner.max_model_len, small)
    assert batch.tokens.shape == (4, 16)  # 40 tokens: 3 rows, 3 tokens: 1 row
    assert batch.continues.tolist() == [0, 1, 1, 0]
    assert batch.owners.tolist() == [0, 0, 0, 1] and batch.last_rows().tolist() == [2, 3]
    assert batch.positions[:, 0].tolist() == [8, 24, 40, 0]
    assert batch.lengths.tolist() == [16, 16, 8, 3]
    assert batch.tokens[2, :8].tolist() == list(range(33, 41))
    with pytest.raises(ValueError, match="draft"):
        build_packed([dataclasses.replace(chunks[0], num_drafts=2)], runner.plan, 512, small)
    # every program a step can need is among the warmup's shapes
    limits = PackLimits.for_steps(64, 32)
    shapes = packed_shapes(64, 4, limits)
    for lengths in ([32, 32], [1, 1, 1, 1], [32, 17, 9, 6], [20]):
        size = segment_size(lengths, limits)
        assert (bucket_rows(segment_rows(lengths, size)), size) in shapes


_RUNNER = []


def _runner():
    if not _RUNNER:
        _RUNNER.append(
            make_runner(
                str(DEFAULT_MODEL),
                dtype="float32",
                max_model_len=512,
                max_num_seqs=4,
                max_prefill_chunk=256,
            )
        )
    return _RUNNER[0]


def test_packed_prefill_equals_one_row_per_chunk():
    """Two steps on two disjoint sets of pages: packed with 16-token rows (chained Mamba
    states across up to 5 rows, chunks that continue cached states) and unpacked. The
    sampled rows' logits agree, and so does a decode step after them (states and KV)."""
    runner = _runner()
    rng = np.random.default_rng(0)
    steps = [
        [("a", 0, 40), ("b", 0, 23)],
        [("a", 40, 70), ("b", 23, 7), ("c", 0, 37)],  # continue cached states; a new one
    ]
    prompts = {r: rng.integers(2, runner.cfg.vocab_size, 200).tolist() for r in "abc"}
    tables = {}
    page = 1
    for side in ("packed", "rows"):
        for req in "abc":
            tables[side, req] = runner.scratch_tables(200, page)
            page = max(p for t in tables[side, req] for p in t) + 1
    # at most 8 rows of 16 a program: the second step runs as two programs (a and b, then c)
    runner.pack_limits, limits = PackLimits(16, 8, 128), runner.pack_limits
    try:
        got = {}
        for step in steps:
            for side in ("packed", "rows"):
                chunks = [_chunk(r, prompts[r][s : s + n], s, tables[side, r]) for r, s, n in step]
                groups = split_chunks(chunks, runner.pack_limits)
                assert len(groups) == (1 if len(step) == 2 else 2)
                out = runner.compute_logits(
                    SchedulerOutput(tuple(chunks)), keep_hidden=side == "rows"
                )
                got[side] = np.asarray(out.logits)[: len(chunks), 0]
            np.testing.assert_allclose(got["packed"], got["rows"], **TOL)
        ends = {r: s + n for r, s, n in steps[1]}
        for side in ("packed", "rows"):
            chunks = [
                ScheduledChunk(r, (prompts[r][ends[r]],), ends[r], tables[side, r], True)
                for r in "abc"
            ]
            batch = build_batch(chunks, runner.plan, runner.max_model_len)
            got[side] = np.asarray(runner.run(batch)[0])[:3, 0]
        np.testing.assert_allclose(got["packed"], got["rows"], **TOL)
    finally:
        runner.pack_limits = limits
