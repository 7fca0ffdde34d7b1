"""The step programs a runner compiles: one per (rows, tokens) bucket that `execute` can need
(decode rows, and packed prefill rows: `runner.packed`).

`warmup` compiles them all before serving (dummy rows on the null page, so the cache is not
touched); `dummy_batch` is one such input, which `runner.memory` also compiles (not runs) for
the largest program's memory analysis.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from hybridserve.cache.plan import CachePlan
from hybridserve.runner.input_batch import BatchArrays, bucket, table_width, token_buckets
from hybridserve.runner.packed import PackLimits, packed_shapes

COMPILE_THREADS_ENV = "HYBRIDSERVE_COMPILE_THREADS"


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
    `progress`: a progress bar.

    The programs compile side by side first (`compile_step`, on up to `compile_threads()`
    threads: XLA's compiler releases the GIL), then each runs once on its dummy batch, which
    reuses the executable compiled for the same shapes (jax keeps it in memory). On 2 CPU
    cores the tiny Inkling's 31 programs (cold cache) took 52.7 s on two threads against
    64.0 s on one."""
    todo = shapes(max_num_seqs, max_tokens, runner.pack_limits)
    batches = [dummy_batch(runner, b, t, packed) for b, t, packed in todo]
    bar = tqdm(total=len(batches), desc="compiling", unit="program", disable=not progress)
    threads = min(compile_threads(), len(batches))
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
            for _ in pool.map(runner.compile_step, batches):
                bar.update()
        bar.close()
        bar = tqdm(total=len(batches), desc="first runs", unit="program", disable=not progress)
    for batch in batches:
        runner.run(batch)
        bar.update()
    bar.close()
    runner.copy_pages([(0, 0)])
    jax.block_until_ready(runner.regions)
    return len(batches) + 1


def compile_threads() -> int:
    """Programs `warmup` compiles at once: `$HYBRIDSERVE_COMPILE_THREADS`; else, on CPU, the
    CPUs this process may use (at most 8), and 1 elsewhere (a GPU compile autotunes its
    kernels on the device, which side-by-side compiles would share; not yet measured)."""
    chosen = os.environ.get(COMPILE_THREADS_ENV)
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"${COMPILE_THREADS_ENV} must be a positive integer, got {chosen!r}")
        return int(chosen)
    if jax.default_backend() != "cpu":
        return 1
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU
    cpus = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, min(8, cpus))
