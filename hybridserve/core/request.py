"""A request as the scheduler sees it: token ids, progress, status and stop rules."""

from __future__ import annotations

import bisect
import dataclasses
import enum
import time
from typing import Any


class RequestStatus(enum.Enum):
    """Where a request is in its life. PREEMPTED requests wait (at the front of the queue) to
    recompute their prompt and outputs; the FINISHED_* states are final."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        """True for the three final states."""
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclasses.dataclass(frozen=True, eq=False)
class MultimodalInput:
    """A prompt's multimodal embeddings: row i of `embeds` ([n, D], any array type) replaces
    the token embedding at prompt position `positions[i]` (ascending). `digest` identifies
    the inputs (it seeds the prompt's prefix-cache hashes, so equal tokens over different
    images never share cached pages)."""

    positions: tuple[int, ...]
    embeds: Any
    digest: bytes

    def rows(self, start: int, stop: int) -> tuple[tuple[int, ...], Any] | None:
        """(offsets from `start`, embedding rows) of the positions in [start, stop)."""
        lo, hi = bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, stop)
        if lo == hi:
            return None
        return tuple(p - start for p in self.positions[lo:hi]), self.embeds[lo:hi]


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request (mutable; owned by the scheduler once added).

    eos_token_ids:       end the request with finish_reason "stop" (empty when ignore_eos).
    stop_token_ids:      the same, and the token becomes `stop_reason`.
    min_tokens:          neither of the above ends the request before it has this many outputs.
    num_computed_tokens: tokens whose cache (KV, state) is written; the next chunk starts here.
    num_cached_tokens:   of those, how many came from the prefix cache at the last admission.
    skip_prefix_cache:   read nothing from the prefix cache (a request that scores its whole
                         prompt: `SamplingParams.prompt_logprobs`); it still adds its pages.
    """

    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    hold_pages: bool = False  # P/D prefill side: keep the pages after finishing until released
    mm: MultimodalInput | None = None
    skip_prefix_cache: bool = False
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # to verify next step

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.req_id!r}: max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"request {self.req_id!r}: min_tokens must be in [0, max_tokens]")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt plus outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """`all_token_ids[start:stop]` without concatenating the whole sequence."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return tuple(self.prompt_token_ids[start:stop])
        if start >= n:
            return tuple(self.output_token_ids[start - n : stop - n])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: stop - n])

    def stop_token(self, token: int) -> tuple[str, int | None] | None:
        """(finish reason, stop reason) when `token`, as the newest output, is an EOS or stop
        token that counts (`min_tokens` outputs exist); else None."""
        if len(self.output_token_ids) < self.min_tokens:
            return None
        if token in self.eos_token_ids:
            return "stop", None
        if token in self.stop_token_ids:
            return "stop", token
        return None

    def check_stop(self, max_model_len: int) -> bool:
        """After an output token was appended: set status and finish_reason if it ends the
        request. EOS and stop tokens count only once `min_tokens` outputs exist; then
        `max_tokens` and `max_model_len` end it with "length"."""
        stop = self.stop_token(self.output_token_ids[-1])
        if stop is not None:
            self.finish(*stop)
            return True
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish("length")
            return True
        return False

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark the request finished: reason "stop", "length" or "abort"."""
        if reason not in FINISH_STATUS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_STATUS)}: {reason!r}")
        self.status = FINISH_STATUS[reason]
        self.finish_reason = reason
        self.stop_reason = stop_reason
