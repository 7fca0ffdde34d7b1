"""The scheduler's side of disaggregated prefill/decode (mixed into `Scheduler`).

Prefill side: a request with `hold_pages` keeps its pages after it finishes (`held_tables`)
until `release_held` (the decode side has read them, or the lease expired). Decode side:
`add_remote_request` allocates what a colocated engine would hold at the request's first
decode step and parks the request (WAITING_FOR_REMOTE_KV) until `finish_remote_kv` reports
the transfer: done (it runs from there) or failed (it recomputes from scratch).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from hybridserve.core.outputs import RemoteSlots
from hybridserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from hybridserve.config import SchedulerConfig
    from hybridserve.core.cache_manager import CacheCoordinator


class RemoteKV:
    """Held pages (prefill side) and parked requests (decode side); the attributes are the
    scheduler's."""

    config: SchedulerConfig
    coordinator: CacheCoordinator
    waiting: deque[Request]
    running: list[Request]
    requests: dict[str, Request]
    held: dict[str, Request]
    held_pages: int
    remote: dict[str, int]
    _order: dict[str, int]
    _counter: int

    def held_tables(self, req_id: str) -> tuple[tuple[int, ...], ...]:
        """Block tables of a finished request whose pages are held for a remote reader."""
        return self.coordinator.block_tables(self.held[req_id])

    def release_held(self, req_id: str) -> bool:
        """Free the pages of a held request (read by the decode side, or its lease expired)."""
        request = self.held.pop(req_id, None)
        if request is None:
            return False
        self.held_pages -= self._num_pages(request)
        self.coordinator.free(request, keep_state=True)
        return True

    def add_remote_request(self, request: Request, num_external_tokens: int) -> RemoteSlots | None:
        """Allocate pages for a request whose first `num_external_tokens` tokens another worker
        computed (`CacheCoordinator.allocate_remote`: what a colocated engine would hold at its
        first decode step, less the whole pages this engine's prefix cache already has) and
        park it until `finish_remote_kv`. Returns the pages and what the transfer must fill,
        or None when there are no seats or pages now (nothing changes; retry later)."""
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already queued")
        if not 0 < num_external_tokens < request.num_prompt_tokens:
            raise ValueError(
                f"request {request.req_id!r}: {num_external_tokens} external tokens "
                f"for a prompt of {request.num_prompt_tokens}"
            )
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: the prompt has "
                f"{request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}"
            )
        if len(self.running) + len(self.remote) >= self.config.max_num_seqs:
            return None
        hit = self.coordinator.find_prefix(request, resume=num_external_tokens)
        fill = self.coordinator.allocate_remote(request, num_external_tokens, hit)
        if fill is None:
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.req_id] = request
        self._order[request.req_id] = self._counter
        self._counter += 1
        self.remote[request.req_id] = num_external_tokens
        return RemoteSlots(
            self.coordinator.block_tables(request),
            fill,
            num_external_tokens,
            request.num_cached_tokens,
        )

    def finish_remote_kv(self, req_id: str, ok: bool) -> None:
        """The transfer for a parked request ended. ok: its tokens count as computed and it runs
        next; not ok: its pages are freed and it recomputes from scratch (queued first)."""
        n = self.remote.pop(req_id, None)
        request = self.requests.get(req_id)
        if n is None or request is None:
            return
        if ok:
            request.num_computed_tokens = n
            self.coordinator.on_computed(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            self.coordinator.free(request, keep_state=False)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _num_pages(self, request: Request) -> int:
        return sum(p != 0 for t in self.coordinator.block_tables(request) for p in t)

    def _pages_will_return(self) -> bool:
        """Pages are held for remote readers or being filled by transfers: they come back
        within a lease or a transfer timeout, so a request that does not fit now waits."""
        return bool(self.held or self.remote)
