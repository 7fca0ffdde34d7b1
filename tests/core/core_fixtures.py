"""Shared helpers for the host-side (core) tests: tiny cache plans, requests, a fake runner that
tracks page contents, and the pool invariants."""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from typing import TYPE_CHECKING

from hybridserve.cache.plan import CacheGroup, CachePlan
from hybridserve.cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridserve.config import SchedulerConfig
from hybridserve.core.outputs import RemoteSlots, SchedulerOutput
from hybridserve.core.request import Request

if TYPE_CHECKING:
    from hybridserve.core.scheduler import Scheduler

VOCAB = 64


def make_plan(
    kinds: str = "MA", block_size: int = 16, kernel_block_size: int = 4, window: int = 8
) -> CachePlan:
    """A plan with one group per letter, in order: M mamba, A full attention, S sliding window
    (`window` tokens). Pages are 1 KiB; only kinds and sizes matter to the host side."""
    attn_bytes = block_size * 1 * 2 * 4 * 4  # 1 kv head x (K, V) x head_dim 4 x float32
    specs = {
        "A": FullAttentionSpec(1, 4, "float32", block_size=block_size),
        "S": SlidingWindowSpec(1, 4, "float32", block_size=block_size, sliding_window=window),
        "M": MambaSpec(8, 4, 3, "float32", (2, 4, 4), "float32", page_size_padded=attn_bytes),
    }
    groups = tuple(CacheGroup(specs[k], (i,)) for i, k in enumerate(kinds))
    return CachePlan(groups, 1, attn_bytes, block_size, kernel_block_size, 1)


def make_config(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=32, max_model_len=256)
    base.update(kw)
    return SchedulerConfig(**base)


def make_request(req_id: str, tokens, max_tokens: int = 4, **kw) -> Request:
    return Request(req_id, list(tokens), max_tokens, **kw)


def next_token(tokens) -> int:
    """The fake model: a deterministic token from the whole sequence."""
    return zlib.crc32(struct.pack(f"<{len(tokens)}i", *tokens)) % VOCAB


def reference(request: Request, max_model_len: int) -> tuple[list[int], str, int | None]:
    """Outputs, finish_reason and stop_reason of the fake model run alone, token by token."""
    seq, out = list(request.prompt_token_ids), []
    while True:
        token = next_token(seq)
        out.append(token)
        seq.append(token)
        if len(out) >= request.min_tokens and token in request.eos_token_ids:
            return out, "stop", None
        if len(out) >= request.min_tokens and token in request.stop_token_ids:
            return out, "stop", token
        if len(out) >= request.max_tokens or len(seq) >= max_model_len:
            return out, "length", None


class ContentRunner:
    """A fake model runner that tracks what every page holds: attention pages the token id at
    each position, state pages the tuple of tokens the state has consumed. Each step applies the
    page copies, checks that every chunk reads exactly its context (window-limited for sliding
    groups; a state of all earlier tokens, or a fresh state at start 0), writes the chunk and
    samples `next_token`."""

    def __init__(self, scheduler: Scheduler) -> None:
        plan = scheduler.coordinator.plan
        self.scheduler = scheduler
        self.block = plan.block_size
        self.kinds = [g.kind for g in plan.groups]
        self.windows = [getattr(g.spec, "sliding_window", None) for g in plan.groups]
        self.tokens: dict[int, list[int | None]] = {}
        self.states: dict[int, tuple[int, ...]] = {}
        self.num_checked = 0

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for src, dst in out.page_copies:
            assert src != 0 and dst != 0 and src != dst
            self.tokens[dst] = list(self.tokens.get(src, [None] * self.block))
            self.states[dst] = self.states.get(src, ("garbage",))
        sampled = {}
        for chunk in out.chunks:
            request = self.scheduler.requests.get(chunk.req_id)
            start, new = chunk.start, list(chunk.token_ids)
            for g, table in enumerate(chunk.block_tables):
                pages = 1 if self.kinds[g] == "mamba" else -(-(start + len(new)) // self.block)
                assert len(table) == pages, f"group {g}: {len(table)} pages, expected {pages}"
            if request is not None:  # else aborted while in flight: write, check nothing
                context = list(request.token_slice(0, start))
                assert request.token_slice(start, start + len(new)) == chunk.token_ids
                self._check(chunk.block_tables, context)
                if chunk.sample:
                    sampled[chunk.req_id] = next_token(context + new)
            self._write(chunk.block_tables, start, new)
        return sampled

    def _check(self, tables, context: list[int]) -> None:
        start, b = len(context), self.block
        for g, table in enumerate(tables):
            if self.kinds[g] == "mamba":
                assert len(table) == 1 and table[0] != 0
                if start:
                    assert self.states.get(table[0]) == tuple(context), "wrong Mamba state"
                continue
            lo = 0 if self.windows[g] is None else max(0, start - self.windows[g])
            for j in range(lo // b, -(-start // b)):
                a, z = max(lo, j * b), min(start, (j + 1) * b)
                assert table[j] != 0, f"group {g} page {j} is null but needed"
                held = self.tokens.get(table[j], [None] * b)[a - j * b : z - j * b]
                assert held == context[a:z], f"group {g} page {table[j]} holds the wrong tokens"
            self.num_checked += 1

    def _write(self, tables, start: int, new: list[int]) -> None:
        b = self.block
        for g, table in enumerate(tables):
            if self.kinds[g] == "mamba":
                old = self.states.get(table[0], ()) if start else ()
                self.states[table[0]] = tuple(old) + tuple(new)
                continue
            for q, token in enumerate(new, start):
                page = self.tokens.setdefault(table[q // b], [None] * b)
                page[q % b] = token

    def transfer(self, slots: RemoteSlots, prompt: list[int]) -> None:
        """A P/D transfer as the connector makes it: every attention group's pages get the
        prompt's tokens [fill_from[g], num_tokens) (the rest of each page keeps whatever it
        held: garbage from earlier owners, or shared prefix pages), every Mamba page the state
        after `num_tokens` tokens."""
        b, n = self.block, slots.num_tokens
        for g, (table, first) in enumerate(zip(slots.block_tables, slots.fill_from, strict=True)):
            if self.kinds[g] == "mamba":
                self.states[table[0]] = tuple(prompt[:n])
                continue
            for q in range(first, n):
                assert table[q // b] != 0, f"group {g}: the transfer fills the null page"
                self.tokens.setdefault(table[q // b], [None] * b)[q % b] = prompt[q]


def run_step(scheduler: Scheduler, runner: ContentRunner):
    """schedule -> fake runner -> update; returns (output, finished)."""
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.step(out))


def check_invariants(scheduler: Scheduler) -> None:
    """Every page's ref count equals its owners (request tables plus the step's copy sources and
    snapshot pages); a page owned by several requests is a cached (prefix) page of one group;
    free pages are exactly those at ref count 0; the null page is never handed out."""
    coord = scheduler.coordinator
    pool = coord.pool
    owners: Counter[int] = Counter(coord.transient_pages)
    group_of: dict[int, int] = {}
    holders: dict[int, set[str]] = {}
    with_pages = {r for r in scheduler.requests if coord.has_pages(r)}
    parked = [scheduler.requests[r] for r in scheduler.remote]
    assert with_pages == {r.req_id for r in scheduler.running} | set(scheduler.remote)
    for request in scheduler.running + parked:
        tables = coord.block_tables(request)
        mine = [p for t in tables for p in t if p != 0]
        assert len(mine) == len(set(mine)), f"{request.req_id} holds a page twice"
        for g, table in enumerate(tables):
            for page in table:
                if page == 0:
                    continue
                owners[page] += 1
                holders.setdefault(page, set()).add(request.req_id)
                assert group_of.setdefault(page, g) == g, f"page {page} in two groups"
    assert pool.ref_count(0) == 0 and 0 not in pool.free_queue()
    free = set(pool.free_queue())
    for page in range(1, pool.num_pages):
        assert pool.ref_count(page) == owners[page], f"page {page}: ref != owners"
        assert (page in free) == (owners[page] == 0), f"page {page}: free queue disagrees"
        if len(holders.get(page, ())) > 1:
            assert pool.is_cached(page), f"page {page} shared but not a prefix page"
    assert pool.num_free == len(free) == pool.num_pages - 1 - len(owners)
