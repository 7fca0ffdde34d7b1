"""The step programs a runner compiles: one per (rows, tokens) bucket that `execute` can need
(decode rows, and packed prefill rows: `runner.packed`).

`warmup` compiles them all before serving (dummy rows on the null page, so the cache is not
touched); `dummy_batch` is one such input, which `runner.memory` also compiles (not runs) for
the largest program's memory analysis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from hybridserve.cache.plan import CachePlan
from hybridserve.runner.input_batch import BatchArrays, bucket, table_width, token_buckets
from hybridserve.runner.packed import PackLimits, packed_shapes


class StepRunner(Protocol):
    """What these functions use of a `ModelRunner` (named structurally: the runner imports
    this module)."""

    plan: CachePlan
    max_model_len: int
    pack_limits: PackLimits
    regions: list[jax.Array]

    def run(self, batch: BatchArrays) -> Any: ...
    def copy_pages(self, copies: list[tuple[int, int]]) -> None: ...
    def compile_step(self, batch: BatchArrays) -> Any: ...


def dummy_batch(runner: StepRunner, rows: int, tokens: int, packed: bool = False) -> BatchArrays:
    """`rows` rows of `tokens` tokens, every page the null page (`packed`: as a packed prefill
    program's input, `runner.packed`, no row continuing another)."""
    width = table_width(runner.plan, runner.max_model_len)
    tables = tuple(
        np.zeros((rows, width) if g.spec.holds_tokens else (rows,), np.int32)
        for g in runner.plan.groups
    )
    batch = BatchArrays(
        np.zeros((rows, tokens), np.int32),
        np.tile(np.arange(tokens, dtype=np.int32), (rows, 1)),
        np.full(rows, tokens, np.int32),
        tables,
        rows,
    )
    if not packed:
        return batch
    return dataclasses.replace(
        batch, continues=np.zeros(rows, np.int32), owners=np.arange(rows, dtype=np.int32)
    )


def shapes(max_num_seqs: int, max_tokens: int, limits: PackLimits) -> list[tuple[int, int, bool]]:
    """(rows, tokens, chained) of every program for batches of up to `max_num_seqs` requests
    and `max_tokens` prompt tokens a step: decode (one token a row) and packed prefill
    (`runner.packed`, within `limits`; its rows may continue others: chained)."""
    decode = [(b, 1, False) for b in token_buckets(bucket(max_num_seqs), 1)]
    prefill = packed_shapes(max_tokens, max_num_seqs, limits)
    return decode + [(b, t, True) for b, t in prefill]


def warmup(runner: StepRunner, max_num_seqs: int, max_tokens: int, progress: bool = False) -> int:
    """Compile every program `execute` can need (and the page copy); returns how many.
    `progress`: a progress bar."""
    todo = shapes(max_num_seqs, max_tokens, runner.pack_limits)
    for b, t, packed in tqdm(todo, desc="compiling", unit="program", disable=not progress):
        runner.run(dummy_batch(runner, b, t, packed))
    runner.copy_pages([(0, 0)])
    jax.block_until_ready(runner.regions)
    return len(todo) + 1
