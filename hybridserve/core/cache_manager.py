"""Per-group cache managers under one coordinator that owns the single `BlockPool`.

Each cache group of the `CachePlan` gets a manager of its kind:
  full_attention: `cdiv(tokens, block_size)` pages per request, grown as tokens are scheduled;
  sliding_window: the same, but pages whose tokens all lie before `computed - window` are
                  freed and replaced by the null page in the request's table;
  mamba:          exactly one running state page per request, taken at admission.
The `CacheCoordinator` keeps every request's per-group page lists (its block tables), allocates
for all groups at once (all or nothing), and runs prefix caching (see `prefix_cache`): lookups,
shared pages, page copies, unit registration and Mamba state snapshots.

A step's lifecycle as the scheduler drives it: `find_prefix` + `allocate_slots` (admission) or
`allocate_slots` (running requests), then `take_page_copies` (ends the schedule: state snapshots
and the step's copies), the runner runs the step, then `on_computed` per request and
`finish_step` (registers snapshots, releases copy sources).

A request whose first tokens another engine computed (the decode side of P/D) is admitted by
`allocate_remote` instead: it takes what a colocated engine would hold at its next step, and
says from which token each group's pages must be filled by the transfer.

Invariant: only valid bytes are ever registered in the prefix cache. A unit k of an attention
group g is registered for a request only when its page is not the null page and its tokens lie at
or after the request's `valid_from[g]`: 0 for a request computed here (its prefix-hit units are
never registered again), the first transferred token for a P/D request (tokens before it are in
shared prefix pages, or were never written: out of the window, or in the part of a page the
transfer skipped). Mamba snapshots are registered only from states at a known position: a
running state after a step, or after a completed transfer.
"""

from __future__ import annotations

from hybridserve.cache.plan import CacheGroup, CachePlan, pages_per_request
from hybridserve.core.block_pool import NULL_PAGE, BlockPool
from hybridserve.core.prefix_cache import (
    PrefixCacheStats,
    PrefixHit,
    chain_hashes,
    find_prefix,
    prefix_unit,
)
from hybridserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    """Pages of one cache group for every request; the tables themselves live in the
    coordinator and are passed in."""

    kind = ""

    def __init__(self, index: int, group: CacheGroup, pool: BlockPool, block_size: int) -> None:
        self.index = index
        self.group = group
        self.pool = pool
        self.block_size = block_size

    @property
    def window(self) -> int | None:
        """The sliding window in tokens (None: keeps every token)."""
        return None

    def pages_needed(self, table: list[int], num_tokens: int) -> int:
        """New pages the table needs to cover `num_tokens` tokens."""
        raise NotImplementedError

    def first_token(self, num_computed: int) -> int:
        """The first cached token a step starting at `num_computed` reads."""
        return 0

    def first_page(self, num_computed: int) -> int:
        """The first page a request with `num_computed` tokens in the cache still holds: the
        pages before it are the null page in its table."""
        return 0

    def drop_out_of_window(self, table: list[int], num_computed: int) -> None:
        """Free pages no future token attends to (sliding windows only)."""

    def free(self, table: list[int]) -> None:
        """Release the table's pages, last page first (so a prefix's first pages, freed last,
        are evicted last)."""
        self.pool.free(reversed(table))


class FullAttentionManager(GroupManager):
    """Attention over every earlier token: one page per `block_size` tokens."""

    kind = "full_attention"

    def pages_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(table))


class SlidingWindowManager(FullAttentionManager):
    """Attention (or a short conv) over the last `window` tokens."""

    kind = "sliding_window"

    @property
    def window(self) -> int:
        return self.group.spec.sliding_window

    def first_token(self, num_computed: int) -> int:
        return max(0, num_computed - self.window)

    def first_page(self, num_computed: int) -> int:
        return max(0, (num_computed - self.window) // self.block_size)

    def drop_out_of_window(self, table: list[int], num_computed: int) -> None:
        # freed pages form a prefix of the table: walk back from the newest one out of window
        for j in range(min(len(table), self.first_page(num_computed)) - 1, -1, -1):
            if table[j] == NULL_PAGE:
                break
            self.pool.free([table[j]])
            table[j] = NULL_PAGE


class MambaManager(GroupManager):
    """One running state page per request, whatever its length."""

    kind = "mamba"

    def pages_needed(self, table: list[int], num_tokens: int) -> int:
        return 0 if table else 1


MANAGERS = {m.kind: m for m in (FullAttentionManager, SlidingWindowManager, MambaManager)}


class CacheCoordinator:
    """The block pool, one manager per cache group, every request's block tables, and prefix
    caching across groups (see the module docstrings of this module and `prefix_cache`)."""

    def __init__(
        self,
        plan: CachePlan,
        num_pages: int,
        unit: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.plan = plan
        self.pool = BlockPool(num_pages)
        self.block_size = plan.block_size
        self.unit = prefix_unit(plan, unit)
        self.caching = enable_prefix_caching
        self.managers = [
            MANAGERS[g.kind](i, g, self.pool, plan.block_size) for i, g in enumerate(plan.groups)
        ]
        self.kinds = tuple(m.kind for m in self.managers)
        self.attention = [i for i, k in enumerate(self.kinds) if k != "mamba"]
        self.mamba = [i for i, k in enumerate(self.kinds) if k == "mamba"]
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[list[int]]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._registered: dict[str, int] = {}  # units registered (or hit) per request
        self._valid_from: dict[str, tuple[int, ...]] = {}  # P/D requests: see the invariant
        self._step_requests: list[Request] = []  # allocated in the step being scheduled
        self._copies: list[tuple[int, int]] = []
        self._copy_refs: list[int] = []  # copy sources of the step being scheduled / in flight
        self._snapshots: list[tuple[tuple[int, bytes], int]] = []  # (key, page) in flight

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def transient_pages(self) -> list[int]:
        """Pages referenced for the step being scheduled or in flight, not by a request: copy
        sources and snapshot pages (one entry per reference)."""
        return self._copy_refs + [page for _, page in self._snapshots]

    def miss(self) -> PrefixHit:
        return PrefixHit.miss(len(self.managers))

    def pages_for(self, num_tokens: int, chunk: int | None = None) -> int:
        """Pages one request of up to `num_tokens` tokens holds at most, computed in steps of
        at most `chunk` tokens (None: any), over all groups: `cache.plan.pages_per_request`, the
        rule that sizes the pool too."""
        chunk = num_tokens if chunk is None else chunk
        return sum(pages_per_request(self.plan, num_tokens, chunk))

    def has_pages(self, req_id: str) -> bool:
        return req_id in self._tables

    def block_tables(self, request: Request) -> tuple[tuple[int, ...], ...]:
        """The request's page ids per group, in plan order (`ScheduledChunk.block_tables`)."""
        return tuple(tuple(t) for t in self._tables[request.req_id])

    # -- allocation ------------------------------------------------------------------------

    def find_prefix(self, request: Request, resume: int | None = None) -> PrefixHit:
        """The longest usable cached prefix of a request about to be admitted (pure lookup).
        `resume`: a P/D request that goes on from there with a transferred state (see
        `prefix_cache.find_prefix`)."""
        if not self.caching or request.skip_prefix_cache:
            return self.miss()
        hashes = self._unit_hashes(request, (request.num_tokens - 1) // self.unit)
        windows = [m.window for m in self.managers]
        return find_prefix(
            self.pool, self.kinds, windows, self.block_size, self.unit, hashes, resume
        )

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Make room for the request's next `num_new_tokens` tokens in every group, or change
        nothing and return False. A request without pages is being admitted: it takes the hit
        (default: none), and its num_computed_tokens and num_cached_tokens become the hit length.
        """
        req_id = request.req_id
        admitting = req_id not in self._tables
        if admitting:
            hit = hit or self.miss()
            tables = [list(pages) for pages in hit.shared]
            start = hit.num_tokens
            held = sum(1 for p in hit.held_pages() if self.pool.ref_count(p) == 0)
        else:
            if hit is not None:
                raise ValueError(f"request {req_id} already has pages: no prefix hit applies")
            tables = self._tables[req_id]
            start = request.num_computed_tokens
            for m, table in zip(self.managers, tables, strict=True):
                m.drop_out_of_window(table, start)
            held = 0
        end = start + num_new_tokens
        needs = [m.pages_needed(t, end) for m, t in zip(self.managers, tables, strict=True)]
        if sum(needs) + held > self.pool.num_free:
            return False
        if admitting:  # take the hit's pages first, so that allocation cannot hand them out
            self.pool.touch(p for table in tables for p in table)
            self._tables[req_id] = tables
            for src in hit.sources:
                if src is not None:
                    self._hold(src)
        for g, n in enumerate(needs):
            if n:
                fresh = self.pool.allocate(n)
                tables[g].extend(fresh)
                if admitting and hit.sources[g] is not None:
                    self._copies.append((hit.sources[g], fresh[0]))
        if admitting:
            request.num_computed_tokens = request.num_cached_tokens = start
            self._registered[req_id] = start // self.unit
            self.stats.num_queries += 1
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += start
        self._step_requests.append(request)
        return True

    def allocate_remote(
        self, request: Request, num_tokens: int, hit: PrefixHit | None = None
    ) -> tuple[int, ...] | None:
        """Admit a request whose first `num_tokens` tokens another engine computed (the decode
        side of P/D), or change nothing and return None when the pool has no room.

        The request takes what a colocated engine would hold at its next step (the first decode
        step, over token `num_tokens`): pages for `num_tokens + 1` tokens, a window group only
        the pages of `[num_tokens - window, num_tokens + 1)` (null pages before). The whole pages
        of a prefix hit (`find_prefix(request, num_tokens)`) are shared; the page holding the hit's
        end, if any, is filled by the transfer like the rest. Returns, per group, the first
        token whose bytes the transfer must bring: attention groups `max(p, first token read)`
        (p: the hit cut to whole pages), rounded down to the kernel block, `num_tokens` or more
        when nothing is needed; Mamba groups 0 (their state page is filled whole: the state after
        `num_tokens` tokens). Until `on_computed` (after the transfer) nothing is registered.
        """
        req_id = request.req_id
        if req_id in self._tables:
            raise ValueError(f"request {req_id} already has pages")
        hit = hit or self.miss()
        size, kernel = self.block_size, self.plan.kernel_block_size
        p = hit.num_tokens // size * size
        tables: list[list[int]] = []
        fill: list[int] = []
        for m, shared in zip(self.managers, hit.shared, strict=True):
            if m.kind == "mamba":
                tables.append([])
                fill.append(0)
                continue
            first = m.first_page(num_tokens)
            own = [NULL_PAGE if j < first else page for j, page in enumerate(shared[: p // size])]
            own += [NULL_PAGE] * (first - len(own))
            assert NULL_PAGE not in own[first:], "a window page of the hit is missing"
            tables.append(own)
            fill.append(max(p, m.first_token(num_tokens) // kernel * kernel))
        taken = {page for table in tables for page in table if page != NULL_PAGE}
        held = sum(1 for page in taken if self.pool.ref_count(page) == 0)
        needs = [
            m.pages_needed(t, num_tokens + 1) for m, t in zip(self.managers, tables, strict=True)
        ]
        if sum(needs) + held > self.pool.num_free:
            return None
        self.pool.touch(page for table in tables for page in table)
        for table, n in zip(tables, needs, strict=True):
            if n:
                table.extend(self.pool.allocate(n))
        self._tables[req_id] = tables
        request.num_computed_tokens = 0
        request.num_cached_tokens = p
        self._registered[req_id] = p // self.unit
        self._valid_from[req_id] = tuple(fill)
        self.stats.num_queries += 1
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += p
        return tuple(fill)

    def free(self, request: Request, keep_state: bool = True) -> None:
        """Release everything the request holds. With `keep_state` (the request's cache is
        consistent: no step in flight writes to it), a running state page that ends on a unit
        boundary is registered as that boundary's snapshot instead of being thrown away."""
        req_id = request.req_id
        tables = self._tables.pop(req_id, None)
        if tables is not None:
            if keep_state:
                self._snapshot_on_free(request, tables)
            for m, table in zip(self.managers, tables, strict=True):
                m.free(table)
        self._hashes.pop(req_id, None)
        self._registered.pop(req_id, None)
        self._valid_from.pop(req_id, None)

    def _hold(self, src: int) -> None:
        """Reference a copy source until the step that copies from it has run."""
        self.pool.touch([src])
        self._copy_refs.append(src)

    # -- the step ---------------------------------------------------------------------------

    def take_page_copies(self) -> tuple[tuple[int, int], ...]:
        """End the schedule: take state snapshots of the step's requests that sit on a unit
        boundary (best effort: only from free pages) and return the step's page copies."""
        if self.caching and self.mamba:
            for request in self._step_requests:
                self._snapshot_by_copy(request)
        self._step_requests.clear()
        copies, self._copies = tuple(self._copies), []
        return copies

    def on_computed(self, request: Request) -> None:
        """After a step (or a completed transfer): register the request's newly full units in
        every attention group, those with valid bytes only (the module's invariant)."""
        if not self.caching or request.req_id not in self._tables:
            return
        full = request.num_computed_tokens // self.unit
        done = self._registered[request.req_id]
        if full <= done:
            return
        hashes = self._unit_hashes(request, full)
        tables = self._tables[request.req_id]
        valid = self._valid_from.get(request.req_id)
        per_page = self.block_size // self.unit
        for k in range(done, full):
            for g in self.attention:
                table = tables[g]
                page = table[k // per_page] if k // per_page < len(table) else NULL_PAGE
                if page != NULL_PAGE and (valid is None or k * self.unit >= valid[g]):
                    self.pool.register((g, hashes[k]), page, k % per_page)
        self._registered[request.req_id] = full

    def finish_step(self) -> None:
        """After a step: register its snapshots (released as cached pages) and release the
        references on its copy sources."""
        for key, page in self._snapshots:
            if self.pool.register(key, page):
                self.stats.num_snapshots += 1
            self.pool.free([page])
        self._snapshots.clear()
        self.pool.free(self._copy_refs)
        self._copy_refs.clear()

    # -- snapshots and hashes ---------------------------------------------------------------

    def _boundary_hash(self, request: Request) -> bytes | None:
        """The hash of the unit ending at num_computed_tokens, if that is a unit boundary."""
        computed = request.num_computed_tokens
        if computed == 0 or computed % self.unit:
            return None
        return self._unit_hashes(request, computed // self.unit)[-1]

    def _snapshot_by_copy(self, request: Request) -> None:
        if request.num_computed_tokens > request.num_prompt_tokens:
            return  # only prompt points: decode snapshots would churn the cache for little gain
        h = self._boundary_hash(request)
        tables = self._tables.get(request.req_id)
        if h is None or tables is None:
            return
        for g in self.mamba:
            if self.pool.lookup((g, h)) is None and self.pool.num_free:
                (page,) = self.pool.allocate(1)
                self._hold(tables[g][0])
                self._copies.append((tables[g][0], page))
                self._snapshots.append(((g, h), page))

    def _snapshot_on_free(self, request: Request, tables: list[list[int]]) -> None:
        if not (self.caching and self.mamba):
            return
        h = self._boundary_hash(request)
        if h is None:
            return
        for g in self.mamba:
            if self.pool.register((g, h), tables[g][0]):
                self.stats.num_snapshots += 1

    def unit_hash(self, request: Request, k: int) -> bytes:
        """The prefix-cache key of the request's unit k (its tokens up to (k + 1) * unit)."""
        return self._unit_hashes(request, k + 1)[k]

    def _unit_hashes(self, request: Request, num_units: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.req_id, [])
        if len(hashes) < num_units:
            seed = b"" if request.mm is None else request.mm.digest
            chain_hashes(request.all_token_ids, self.unit, hashes, num_units, seed)
        return hashes[:num_units]
