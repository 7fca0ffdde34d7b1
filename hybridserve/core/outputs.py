"""The contract between the scheduler (host) and the model runner (device)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """One request's work in one step.

    token_ids:    the tokens to compute now (prompt chunk, or the last sampled token).
    start:        the position of token_ids[0] (= tokens already in the cache).
    block_tables: one tuple per cache group (in `CachePlan.groups` order): for attention groups
                  the logical page ids covering positions [0, start + len(token_ids)) (0, the
                  null page, where a sliding window has freed a page); for Mamba groups a single
                  page, the request's running state.
    sample:       the chunk ends at the last known token: sample the next token from it.
    mm:           multimodal embeddings inside the chunk: (offsets into token_ids, rows [k, D])
                  that replace those tokens' embeddings; None when there are none.
    num_drafts:   the last `num_drafts` token_ids are draft tokens to verify (speculative
                  decoding): the chunk is the last known token followed by the drafts.
    """

    req_id: str
    token_ids: tuple[int, ...]
    start: int
    block_tables: tuple[tuple[int, ...], ...]
    sample: bool
    mm: tuple[tuple[int, ...], Any] | None = None
    num_drafts: int = 0


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step.

    page_copies: (src, dst) whole-page copies to apply in every region, in order, before the
                 step computes (prefix-cache restores and Mamba state snapshots).
    """

    chunks: tuple[ScheduledChunk, ...]
    page_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.page_copies
