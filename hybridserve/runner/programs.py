"""The step programs a runner compiles: one per (rows, tokens) bucket that `execute` can need.

`warmup` compiles them all before serving (dummy rows on the null page, so the cache is not
touched); `dummy_batch` is one such input, which `runner.memory` also compiles (not runs) for
the largest program's memory analysis.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from hybridserve.cache.plan import CachePlan
from hybridserve.runner.input_batch import BatchArrays, bucket, table_width, token_buckets


class StepRunner(Protocol):
    """What these functions use of a `ModelRunner` (named structurally: the runner imports
    this module)."""

    plan: CachePlan
    max_model_len: int
    regions: list[jax.Array]

    def run(self, batch: BatchArrays) -> Any: ...
    def copy_pages(self, copies: list[tuple[int, int]]) -> None: ...
    def compile_step(self, batch: BatchArrays) -> Any: ...


def dummy_batch(runner: StepRunner, rows: int, tokens: int) -> BatchArrays:
    """`rows` rows of `tokens` tokens, every page the null page."""
    width = table_width(runner.plan, runner.max_model_len)
    tables = tuple(
        np.zeros((rows, width) if g.spec.holds_tokens else (rows,), np.int32)
        for g in runner.plan.groups
    )
    return BatchArrays(
        np.zeros((rows, tokens), np.int32),
        np.tile(np.arange(tokens, dtype=np.int32), (rows, 1)),
        np.full(rows, tokens, np.int32),
        tables,
        rows,
    )


def shapes(max_num_seqs: int, max_prefill_chunk: int) -> list[tuple[int, int]]:
    """(rows, tokens) of every program for batches of up to `max_num_seqs` rows and prefill
    chunks of up to `max_prefill_chunk` tokens: decode (one token) and prefill buckets."""
    rows = token_buckets(bucket(max_num_seqs), 1)
    out = [(b, 1) for b in rows]
    return out + [(b, t) for b in rows for t in token_buckets(max(max_prefill_chunk, 16))]


def warmup(runner: StepRunner, max_num_seqs: int, max_prefill_chunk: int) -> int:
    """Compile every program `execute` can need (and the page copy); returns how many."""
    todo = shapes(max_num_seqs, max_prefill_chunk)
    for b, t in todo:
        runner.run(dummy_batch(runner, b, t))
    runner.copy_pages([(0, 0)])
    jax.block_until_ready(runner.regions)
    return len(todo) + 1
