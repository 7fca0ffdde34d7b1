"""Continuous batching over the paged hybrid cache, with chunked prefill, prefix caching and
preemption by recompute.

Each `schedule()` builds one step under a token budget (`max_num_batched_tokens`), a budget
for all prompt chunks together while any running request decodes (`max_num_prefill_tokens`:
the decodes' inter-token latency stays bounded; a step of prompts alone takes the whole
budget) and a seat limit (`max_num_seqs` running requests):
  1. Running requests: with `decode_first` (the default) every decoding request first, in
     arrival order, 1 token each (plus its drafts), then those still reading their prompt, a
     chunk of `min(remaining, max_prefill_chunk, budgets left)` tokens each; without it, all
     in arrival order. Since the budget holds at least `max_num_seqs` tokens, no decode waits
     for a prompt. With prefix caching on a model with Mamba groups, a chunk that would cross
     a prefix-unit boundary ends on the last boundary it crosses, so that a state snapshot can
     be taken there.
     When the pool has no room, the most recently arrived running request not yet scheduled in
     this step (possibly the one being scheduled) is preempted: its pages are freed, it goes
     back to the front of the waiting queue and later recomputes its prompt and outputs.
  2. If nothing was preempted, waiting requests are admitted in order (prefix lookup first;
     one whose next prefix unit a running prompt is computing now stays in the queue, and
     those behind it may pass it, until that unit is cached)
     while both budgets, seats and pages last.
Prefill and decode chunks mix in one step. `update_from_output(out, sampled)` then advances the
requests, appends sampled tokens, applies the stop rules and frees finished requests.

Disaggregated prefill/decode: `RemoteKV` (core/remote_kv.py) holds a finished prefill's
pages for its decode side, and parks a decode-side request until its KV has arrived.

`schedule()` and `update_from_output()` alternate: a non-empty output must be updated before the
next schedule. `abort_request` and `finish_request` may be called at any time; a request
aborted while its step is in flight has its pages freed at once (nothing reuses them before the
next `schedule()`), and the in-flight chunk is ignored on update.
"""

from __future__ import annotations

from collections import deque

from hybridserve.cache.plan import CachePlan
from hybridserve.config import SchedulerConfig
from hybridserve.core.cache_manager import CacheCoordinator
from hybridserve.core.outputs import PENDING_TOKEN, ScheduledChunk, SchedulerOutput
from hybridserve.core.prefix_cache import PrefixCacheStats
from hybridserve.core.remote_kv import RemoteKV
from hybridserve.core.request import Request, RequestStatus


class PoolTooSmall(RuntimeError):
    """The cache pool cannot hold request `req_id` on its own, even with nothing else in it
    (the engine fails that request and keeps serving)."""

    def __init__(self, message: str, req_id: str) -> None:
        super().__init__(message)
        self.req_id = req_id


class Scheduler(RemoteKV):
    """Admission, chunking, preemption and stop rules over one `CacheCoordinator`; the
    disaggregated prefill/decode methods come from `RemoteKV`."""

    def __init__(self, plan: CachePlan, num_pages: int, config: SchedulerConfig) -> None:
        self.config = config
        self.coordinator = CacheCoordinator(
            plan, num_pages, config.prefix_unit, config.enable_prefix_caching
        )
        self.prefix_unit = self.coordinator.unit
        self.align_chunks = config.enable_prefix_caching and bool(self.coordinator.mamba)
        # recurrent (Mamba) states cannot be rolled back: a verifying step keeps them before
        # the drafts, so accepted drafts are computed again, in the next step's chunk
        self.recurrent = bool(self.coordinator.mamba)
        self.max_drafts = 0  # speculative decoding: drafts per step (set by the engine)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self._order: dict[str, int] = {}  # arrival tie-break
        self._counter = 0
        self._in_flight: SchedulerOutput | None = None
        self._in_flight_ids: set[str] = set()
        self.held: dict[str, Request] = {}  # finished, pages kept for a remote reader
        self.held_pages = 0  # pages of the held requests (a shared page counts per holder)
        self.max_held_pages = max(1, int(config.max_held_fraction * (num_pages - 1)))
        self.remote: dict[str, int] = {}  # parked for remote KV: req_id -> external tokens

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate req_id or a prompt of
        `max_model_len` tokens or more (a longer total is fine: it stops at max_model_len)."""
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already queued")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: the prompt has {request.num_prompt_tokens} tokens; "
                f"max_model_len is {self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self._order[request.req_id] = self._counter
        self._counter += 1
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> Request | None:
        """End a waiting, running or preempted request (FINISHED_ABORTED, reason "abort") and
        free its pages. Returns it, or None if it is unknown or already finished."""
        return self.finish_request(req_id, "abort")

    def finish_request(
        self, req_id: str, reason: str = "stop", stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request from outside (the engine's stop strings): reason "stop", "length" or
        "abort". Returns it, or None if it is unknown or already finished."""
        request = self.requests.get(req_id)
        if request is None:
            return None
        request.finish(reason, stop_reason)
        self._retire(request, keep_state=req_id not in self._in_flight_ids)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def usage(self) -> float:
        """Fraction of the pages in use (cached free pages count as free)."""
        return self.coordinator.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.coordinator.stats

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step (see the module docstring)."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update_from_output()")
        budget = self.config.max_num_batched_tokens
        # prompt chunks together: capped while requests decode (their next token waits for the
        # step); a step of prompts alone takes the whole budget
        decodes = any(self._decoding(r) for r in self.running)
        prompt_budget = (decodes and self.config.max_num_prefill_tokens) or budget
        chunks: list[ScheduledChunk] = []
        done: set[str] = set()  # scheduled in this step
        preempted = False
        order = self.running
        if self.config.decode_first:  # stable: decodes in arrival order, then the prompts
            order = sorted(self.running, key=lambda r: not self._decoding(r))
        for request in order:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted by an earlier one of this step
            decoding = self._decoding(request)
            limit = budget if decoding else min(budget, prompt_budget)
            if limit <= 0:
                continue  # the prompts' share is spent; decodes may follow (arrival order)
            n = self._chunk_size(request, request.num_computed_tokens, limit)
            while not self.coordinator.allocate_slots(request, n):
                victim = max((r for r in self.running if r.req_id not in done), key=self._arrival)
                alone = not done and len(self.running) == 1
                if victim is request and alone and not self._pages_will_return():
                    raise self._too_small(request, n)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append(self._chunk(request, n))
                done.add(request.req_id)
                budget -= n
                if not decoding:
                    prompt_budget -= n
        deferred: list[Request] = []  # waiting for a prefix that a running prompt computes
        try:
            while (
                not preempted
                and self.waiting
                and min(budget, prompt_budget) > 0
                and len(self.running) < self.config.max_num_seqs
            ):
                request = self.waiting[0]
                if request.hold_pages and self.held_pages >= self.max_held_pages:
                    break  # held pages are bounded: wait for reads, releases or leases to end
                hit = self.coordinator.find_prefix(request)
                if self._prefix_in_flight(request, hit.num_tokens):
                    deferred.append(self.waiting.popleft())  # read that prefix once it is cached
                    continue
                limit = min(budget, prompt_budget)
                n = self._chunk_size(request, hit.num_tokens, limit)
                if not self.coordinator.allocate_slots(request, n, hit):
                    if self.running or self._pages_will_return():
                        break
                    # alone in the pool: copy sources hold extra pages, so try without the hit
                    n = self._chunk_size(request, 0, limit)
                    if not self.coordinator.allocate_slots(request, n, self.coordinator.miss()):
                        raise self._too_small(request, n)
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                chunks.append(self._chunk(request, n))
                budget -= n
                prompt_budget -= n
        finally:
            self.waiting.extendleft(reversed(deferred))  # at the front, in their order
        out = SchedulerOutput(tuple(chunks), self.coordinator.take_page_copies())
        if chunks:
            self._in_flight = out
            self._in_flight_ids = {c.req_id for c in chunks}
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> list[Request]:
        """Apply a computed step: advance each chunk's request, append its sampled token
        (`sampled[req_id]` for chunks with sample=True), register new prefix units and
        snapshots, apply the stop rules and free finished requests. Returns the requests that
        finished in this step (aborted ones are not included).

        A chunk with drafts gets a list: its accepted drafts then one more token. Only the
        accepted positions count as computed (the rejected drafts' cache entries are rewritten
        when those positions are computed again), and with recurrent layers none of the drafts
        (`recurrent`); a stop rule met midway drops the rest."""
        if out is not self._in_flight:
            if out.is_empty and self._in_flight is None:
                return []
            raise RuntimeError("update_from_output() expects the output of the last schedule()")
        live = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or finished while the step was in flight
            if chunk.sample and chunk.req_id not in sampled:
                raise KeyError(f"no sampled token for request {chunk.req_id!r}")
            live.append((chunk, request))
        self._in_flight = None
        self._in_flight_ids = set()
        finished: list[Request] = []
        for chunk, request in live:
            got = sampled.get(chunk.req_id)
            tokens = [got] if isinstance(got, int) else list(got or [])
            accepted = max(len(tokens) - 1, 0) if chunk.num_drafts and not self.recurrent else 0
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_drafts + accepted
            request.draft_token_ids = []
            if chunk.sample:
                for token in tokens:
                    request.output_token_ids.append(int(token))
                    if request.check_stop(self.config.max_model_len):
                        finished.append(request)
                        break
            # a stop midway leaves accepted drafts unrecorded: they are not computed tokens
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            self.coordinator.on_computed(request)
        self.coordinator.finish_step()
        for request in finished:
            self._retire(request, keep_state=True)
        return finished

    def settle(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], updated: list[Request]
    ) -> list[Request]:
        """Overlapped steps: `out` was updated with `PENDING_TOKEN`s (its finished requests,
        by length: `updated`), the next step scheduled since; these are its real tokens. Each
        replaces its request's newest output; one that is an EOS or stop token finishes its
        request now (or corrects the reason of one the update finished by length). Returns
        the requests that finished in `out`."""
        done = {r.req_id: r for r in updated}
        finished = list(updated)
        for chunk in out.chunks:
            tokens = sampled.get(chunk.req_id)
            request = done.get(chunk.req_id) or self.requests.get(chunk.req_id)
            if not chunk.sample or not tokens or request is None:
                continue  # aborted or finished meanwhile
            outputs = request.output_token_ids
            if not outputs or outputs[-1] != PENDING_TOKEN:
                continue  # preempted and recomputed: not this step's token
            outputs[-1] = int(tokens[0])
            stop = request.stop_token(outputs[-1])
            if stop is None:
                continue
            if chunk.req_id in done:
                request.finish(*stop)
            elif self.finish_request(chunk.req_id, *stop) is not None:
                finished.append(request)
        return finished

    def draft_rooms(self, out: SchedulerOutput) -> dict[str, int]:
        """Speculative decoding, after `update_from_output`: for each request of `out` that
        sampled and still runs, how many drafts its max_tokens and max_model_len leave room for
        after its next token."""
        rooms = {}
        for chunk in out.chunks:
            request = self.requests.get(chunk.req_id)
            if chunk.sample and request is not None and request.status is RequestStatus.RUNNING:
                n_out = len(request.output_token_ids)
                rooms[chunk.req_id] = min(
                    request.max_tokens - n_out - 1, self.config.max_model_len - request.num_tokens
                )
        return rooms

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Keep the runner's drafts for running requests: the next step verifies them (a
        request whose budget is short then drops them)."""
        for req_id, tokens in drafts.items():
            request = self.requests.get(req_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                request.draft_token_ids = [int(t) for t in tokens]

    # -- helpers ----------------------------------------------------------------------------

    def _prefix_in_flight(self, request: Request, hit: int) -> bool:
        """Does a running prompt (a sibling of `n` > 1, or one that starts alike) share more
        of `request`'s prefix than its hit of `hit` tokens, and still have to compute or
        snapshot some of it? Then `request` stays queued (those behind it may pass) and reads
        that prefix once it is cached, instead of computing the same tokens beside it. The wait
        ends when the other prompt is past the shared part (or has left)."""
        unit, coordinator = self.prefix_unit, self.coordinator
        if not coordinator.caching or request.skip_prefix_cache:
            return False
        k = hit // unit  # the first unit the hit lacks
        limit = (request.num_tokens - 1) // unit  # the units a hit may cover
        for other in self.running:
            top = min(limit, other.num_prompt_tokens // unit)
            if top <= k or other.num_computed_tokens > top * unit:
                continue  # nothing more to share, or past all of it
            if other.num_cached_tokens % coordinator.block_size:
                continue  # its first page mixes cached and own units: no hit runs through it
            m = k  # units shared (the hashes chain: equal at m means equal before)
            while m < top and coordinator.unit_hash(request, m) == coordinator.unit_hash(other, m):
                m += 1
            # `<=`: a prompt that stopped at the shared part's end has its state snapshot
            # copied at the end of this schedule, cached after the step
            if m > k and other.num_computed_tokens <= m * unit:
                return True
        return False

    def _decoding(self, request: Request) -> bool:
        """Its prompt and outputs are computed but for the last sampled token (with recurrent
        layers and drafts: but for the tokens of its last verifying step)."""
        return self._verifies(request, request.num_computed_tokens)

    def _verifies(self, request: Request, start: int) -> bool:
        """A decode chunk from `start` (which verifies the request's drafts, if it has any):
        the last sampled token, or with recurrent layers the last step's accepted drafts and
        its sampled token."""
        pending = request.num_tokens - start
        if pending == 1:
            return True
        recomputes = self.recurrent and self.max_drafts and request.draft_token_ids
        return bool(recomputes) and 1 < pending <= 1 + self.max_drafts

    def _chunk_size(self, request: Request, start: int, budget: int) -> int:
        if request.draft_token_ids and self._verifies(request, start):
            # a decode step that verifies drafts: all of them, or none when the budget is short
            pending = request.num_tokens - start
            if pending + len(request.draft_token_ids) <= budget:
                return pending + len(request.draft_token_ids)
            request.draft_token_ids = []
        n = min(request.num_tokens - start, self.config.max_prefill_chunk, budget)
        if self.align_chunks:
            end = start + n
            aligned = end - end % self.prefix_unit
            if aligned > start:
                n = aligned - start
        return n

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        drafts = request.draft_token_ids if n > request.num_tokens - start else []
        return ScheduledChunk(
            req_id=request.req_id,
            token_ids=request.token_slice(start, start + n - len(drafts)) + tuple(drafts),
            start=start,
            block_tables=self.coordinator.block_tables(request),
            sample=start + n - len(drafts) == request.num_tokens,
            mm=None if request.mm is None else request.mm.rows(start, start + n),
            num_drafts=len(drafts),
        )

    def _arrival(self, request: Request) -> tuple[float, int]:
        return (request.arrival_time, self._order[request.req_id])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.coordinator.free(request, keep_state=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _retire(self, request: Request, keep_state: bool) -> None:
        """Drop a request that just got a FINISHED_* status from the queues and the cache."""
        del self.requests[request.req_id]
        del self._order[request.req_id]
        if self.remote.pop(request.req_id, None) is not None:
            keep_state = False  # its pages may still be being written
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.hold_pages and request.finish_reason != "abort":
            self.held[request.req_id] = request
            self.held_pages += self._num_pages(request)
        else:
            self.coordinator.free(request, keep_state)

    def _too_small(self, request: Request, n: int) -> PoolTooSmall:
        c = self.coordinator
        chunk = self.config.max_prefill_chunk
        need = c.pages_for(request.num_computed_tokens + n, chunk)
        full = c.pages_for(self.config.max_model_len, chunk)
        return PoolTooSmall(
            f"the cache pool ({c.pool.num_pages - 1} usable pages) cannot hold request "
            f"{request.req_id!r} on its own: {request.num_computed_tokens + n} tokens need {need} "
            f"pages, and max_model_len {self.config.max_model_len} needs {full}; give the cache "
            "more pages or lower max_model_len",
            request.req_id,
        )
