"""All-position logits of one chunk or one whole sequence, bypassing the scheduler's batching:
for checks, checkpoint verification (`checkpoints/verify.py`) and prompt logprobs
(`runner.prompt_logprobs`). A `ModelRunner` has these methods."""

from __future__ import annotations

from typing import Any

import jax

from hybridserve.cache.plan import CachePlan
from hybridserve.core.outputs import ScheduledChunk
from hybridserve.core.request import MultimodalInput
from hybridserve.runner.input_batch import BatchArrays, build_batch


class ScratchLogits:
    """Every position's logits, one chunk a program (rows of 1, tokens padded to 16s)."""

    plan: CachePlan
    max_model_len: int
    num_pages: int

    def run(self, batch: BatchArrays, n_logits: int | None = 1, **kw: Any) -> Any: ...

    def chunk_logits(self, chunk: ScheduledChunk) -> jax.Array:
        """Logits [T', V] of every position of `chunk` (T' >= its length: padded rows after),
        through its block tables (the cache is written as a step would)."""
        batch = build_batch([chunk], self.plan, self.max_model_len, 16)
        return self.run(batch, n_logits=None)[0][0]

    def prompt_logits(self, chunk: ScheduledChunk) -> jax.Array:
        """All-position logits [T, V] of one chunk (for checks and verification)."""
        return self.chunk_logits(chunk)[: len(chunk.token_ids)]

    def scratch_tables(self, num_tokens: int, first_page: int = 1) -> tuple[tuple[int, ...], ...]:
        """Block tables for one sequence of `num_tokens` on consecutive pages from `first_page`,
        bypassing the scheduler (for checks and verification only)."""
        tables, page = [], first_page
        for group in self.plan.groups:
            n = -(-num_tokens // self.plan.block_size) if group.spec.holds_tokens else 1
            tables.append(tuple(range(page, page + n)))
            page += n
        if page > self.num_pages:
            raise ValueError(
                f"{num_tokens} tokens need {page} pages; the pool has {self.num_pages}"
            )
        return tuple(tables)

    def sequence_logits(self, token_ids: list[int], mm: MultimodalInput | None = None) -> jax.Array:
        """All-position logits [T, V] of one sequence computed from scratch (`mm`: its
        multimodal embeddings, from `multimodal_prompt`)."""
        tables = self.scratch_tables(len(token_ids))
        rows = None if mm is None else mm.rows(0, len(token_ids))
        chunk = ScheduledChunk("scratch", tuple(token_ids), 0, tables, True, rows)
        return self.prompt_logits(chunk)
