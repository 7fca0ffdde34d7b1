"""The contract between the scheduler (host) and the model runner (device)."""

from __future__ import annotations

import dataclasses
from typing import Any

# A token sampled by a step still on the device (overlapped steps): the scheduler appends it to
# the request and schedules the next step with it; the runner reads the real id on the device,
# and the engine settles it on the host when that step's tokens arrive.
PENDING_TOKEN = -1


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


@dataclasses.dataclass(frozen=True)
class RemoteSlots:
    """The pages a P/D request got on the decode side (`Scheduler.add_remote_request`), and
    what its transfer must fill.

    block_tables:      per cache group (plan order), as in `ScheduledChunk`, covering
                       `num_tokens + 1` tokens (the first decode step's token too); a window
                       group holds only its window (null pages before), and the whole pages of
                       a decode-side prefix hit come first (shared: the transfer skips them).
    fill_from:         per group, the first token whose bytes the transfer brings: attention
                       groups a multiple of the kernel block (`num_tokens` or more: nothing);
                       Mamba groups 0 (the state page is filled whole: the state after
                       `num_tokens` tokens).
    num_tokens:        the tokens another engine computed.
    num_cached_tokens: tokens the decode side's own prefix cache served (whole pages).
    """

    block_tables: tuple[tuple[int, ...], ...]
    fill_from: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int = 0
