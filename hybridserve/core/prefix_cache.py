"""Prefix caching for hybrid (Mamba2 + attention) models, at a granularity that actually hits.

The unified page of a hybrid is large: an attention page must hold as many bytes as one Mamba
state, so for Nemotron-3-Nano-30B at TP 1 with fp8 KV a page is 4176 tokens (kernel block 16 x
ratio 261). Caching whole pages would almost never hit, so the cache works in *prefix units*:

- Unit size G: `SchedulerConfig.prefix_unit` if set, else the block size when it is <= 256, else
  the largest `kernel_block_size * d` <= 256 with `d` dividing `plan.ratio` (Nano-30B TP 1:
  d = 9, G = 144). G always divides the block size, so a page holds U = block_size / G units.
- Content hashes, chained per full unit: `h_k = sha256(h_{k-1} || int64 LE token ids of unit
  k)`, `h_{-1}` empty. Stable across processes and machines.
- Attention groups: when unit k of a request is fully computed, the pool records
  `(g, h_k) -> (page, k % U)` for every attention group g (the page holding it in that group).
  The entries of a page are dropped when the page is handed out again (eviction).
- Mamba groups keep *state snapshots* at unit boundaries: when a step ends with a request's
  computed length p on a unit boundary inside its prompt (p <= prompt length: snapshots while
  decoding would churn the cache for little gain), the next step that schedules the request
  copies its running state page into a fresh page first, if one is free
  (`SchedulerOutput.page_copies` run before the step computes, so the copy is the state at
  exactly p); after that step the snapshot page is registered as `(g, h_{p/G-1}) -> (page, 0)`
  and released with ref count 0 (cached, evictable).
  A request that ends (finishes, or is preempted) on a boundary registers its running state page
  itself, without a copy.
- The scheduler ends prefill chunks on unit boundaries whenever a chunk would cross one, so a
  prompt leaves snapshots at G-aligned points (only a tail shorter than G ends unaligned).

Lookup (`find_prefix`, on admission): the hit is p = n * G for the largest n such that
  p <= num_tokens - 1 (at least one token is computed, to get logits),
  every full-attention group has entries for units 0..n-1, and the units of each page come
  from one cached page (a full page made of several cached pages cannot be shared, a partial
  one cannot be copied from one page: n is cut back to the first unit where this breaks),
  every sliding-window group has the same for the units overlapping [p - window, p) only (its
  pages before the window are freed early, and evicted early, so they are not asked for), and
  every Mamba group has a snapshot for unit n-1.
Pages of the new request entirely inside [0, p) are SHARED (ref count + 1, no copy); the page
holding p, when p is not on a page boundary, is allocated fresh and filled by copying the cached
page (the units past p in it are garbage the request overwrites, and never reads before); Mamba
groups get a fresh running state page filled by copying the snapshot. Sliding-window pages wholly
before `p - window` are not taken at all (null page). Copy sources hold a reference until the
step that copies from them has run. Without Mamba groups the same code hits at unit granularity.

The decode side of P/D (`CacheCoordinator.allocate_remote`) looks up with `resume` = the tokens
the prefill engine computed: the transfer brings the Mamba state at `resume`, so no snapshot is
needed, and a sliding-window group needs only the units overlapping `[resume - window, p)` (none
when the window starts after p). It shares the hit's whole pages and has the transfer fill the
rest (the page holding p included), so no copy races the transfer's writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

from hybridserve.cache.plan import CachePlan
from hybridserve.config import ConfigError
from hybridserve.core.block_pool import NULL_PAGE, BlockPool

MAX_AUTO_UNIT = 256


def prefix_unit(plan: CachePlan, requested: int | None = None) -> int:
    """Prefix-cache granularity G in tokens (see the module docstring); always divides the
    block size."""
    if requested is not None:
        if requested <= 0 or plan.block_size % requested:
            raise ConfigError(
                f"prefix_unit = {requested} must be > 0 and divide the block size {plan.block_size}"
            )
        return requested
    if plan.block_size <= MAX_AUTO_UNIT:
        return plan.block_size
    a, ratio = plan.kernel_block_size, plan.ratio
    fits = [a * d for d in range(1, ratio + 1) if ratio % d == 0 and a * d <= MAX_AUTO_UNIT]
    return max(fits, default=a)


def chain_hashes(
    tokens: Sequence[int], unit: int, hashes: list[bytes], num_units: int, seed: bytes = b""
) -> list[bytes]:
    """Extend `hashes` (the chained hashes of `tokens`' first units) in place to `num_units`
    units, and return it. Needs `num_units * unit <= len(tokens)`. `seed` is the parent of the
    first unit (a multimodal prompt's digest)."""
    if num_units * unit > len(tokens):
        raise ValueError(f"{num_units} units of {unit} need more than {len(tokens)} tokens")
    parent = hashes[-1] if hashes else seed
    for k in range(len(hashes), num_units):
        ids = tokens[k * unit : (k + 1) * unit]
        parent = hashlib.sha256(parent + struct.pack(f"<{unit}q", *ids)).digest()
        hashes.append(parent)
    return hashes


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The result of a lookup, per cache group (in plan order).

    num_tokens: the hit length p (a multiple of the unit; 0 = no hit).
    shared:     attention groups: the cached pages the request takes as its first pages (the
                null page for sliding-window pages out of the window); () for Mamba groups.
    sources:    the page to copy into the request's first fresh page of the group (the cached
                page holding p for attention, the snapshot for Mamba), or None.
    """

    num_tokens: int
    shared: tuple[tuple[int, ...], ...]
    sources: tuple[int | None, ...]

    @classmethod
    def miss(cls, num_groups: int) -> PrefixHit:
        return cls(0, ((),) * num_groups, (None,) * num_groups)

    def held_pages(self) -> set[int]:
        """Every page the hit takes a reference on (shared pages and copy sources)."""
        pages = {p for group in self.shared for p in group if p != NULL_PAGE}
        return pages | {p for p in self.sources if p is not None}


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache counters since start. One query per admission (re-admissions after a
    preemption count again)."""

    num_queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    num_snapshots: int = 0  # Mamba state snapshots registered (copies plus end-of-life pages)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def find_prefix(
    pool: BlockPool,
    kinds: Sequence[str],
    windows: Sequence[int | None],
    block_size: int,
    unit: int,
    hashes: Sequence[bytes],
    resume: int | None = None,
) -> PrefixHit:
    """The longest usable cached prefix of a request whose unit hashes (at most the units
    before its last token) are `hashes`. `kinds[g]` is group g's kind and `windows[g]` its
    sliding window (None when it has none). `resume` (P/D decode side): the request goes on from
    that position (>= the hit) with a state brought another way, so Mamba groups neither limit
    the hit nor give a source, and sliding windows count back from `resume`; without attention
    groups that is a miss. Pure: changes nothing."""
    per_page = block_size // unit
    memo: dict[tuple[int, int], int | None] = {}

    def page_of(g: int, k: int) -> int | None:
        """The cached page holding unit k in group g (at its slot), or None."""
        if (g, k) not in memo:
            entry = pool.lookup((g, hashes[k]))
            memo[g, k] = entry[0] if entry is not None and entry[1] == k % per_page else None
        return memo[g, k]

    def first_needed(g: int, n: int) -> int:
        """The first unit that a hit of n units must hold in group g (window-limited; n or
        more: none)."""
        window = windows[g]
        end = n * unit if resume is None else max(n * unit, resume)
        return 0 if window is None else max(0, (end - window) // unit)

    def consistent(g: int, first: int, n: int) -> int:
        """The largest m <= n such that units first..m-1 are cached and each page's units come
        from one cached page."""
        current = None
        for k in range(first, n):
            page = page_of(g, k)
            if page is None or (k != first and k % per_page and page != current):
                return k
            current = page
        return n

    full = [g for g, kind in enumerate(kinds) if kind == "full_attention"]
    sliding = [g for g, kind in enumerate(kinds) if kind == "sliding_window"]
    mamba = [g for g, kind in enumerate(kinds) if kind == "mamba"] if resume is None else []
    n = len(hashes) if resume is None or full or sliding else 0
    for g in full:
        n = consistent(g, 0, n)
    while n and not (
        all(pool.lookup((g, hashes[n - 1])) for g in mamba)
        and all(consistent(g, first_needed(g, n), n) == n for g in sliding)
    ):
        n -= 1
    if n == 0:
        return PrefixHit.miss(len(kinds))
    p = n * unit
    shared: list[tuple[int, ...]] = []
    sources: list[int | None] = []
    for g, kind in enumerate(kinds):
        if kind == "mamba":
            shared.append(())
            sources.append(None if resume is not None else pool.lookup((g, hashes[n - 1]))[0])
            continue
        first = first_needed(g, n)
        pages = [
            NULL_PAGE if (j + 1) * per_page <= first else page_of(g, max(first, j * per_page))
            for j in range(p // block_size)
        ]
        shared.append(tuple(pages))
        k = max(first, p // block_size * per_page)  # the unit that holds the partial page
        sources.append(page_of(g, k) if p % block_size and k < n else None)
    return PrefixHit(p, tuple(shared), tuple(sources))
