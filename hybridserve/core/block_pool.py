"""The one pool of pages that every cache group allocates from, and the prefix-cache map.

Page ids are 0..num_pages-1 and valid in every region (see `cache.plan`). Page 0 is the null page:
it is never handed out and stands for "no page" in block tables (a sliding window's freed pages).

A page is in use while its ref count is > 0. At ref count 0 it sits in the free queue, which is
in LRU order: `allocate` takes from the head. A freed page that carries prefix-cache entries
goes to the tail, so cached content is evicted least-recently-freed first; freed pages without
entries go to the head, since nothing is lost by reusing them at once: those of one `free` call
as one block in ascending id order, so a run of consecutive pages comes back as the same
ascending run (whatever order it was freed in: the cache managers free a table last page
first), which keeps a request's pages consecutive for whole-run transfers (`disagg`). A cached
free page can be taken back by `touch` (a prefix hit); handing it out through `allocate` drops
its entries (that is the eviction). Every operation is O(1) per page, but for sorting the
uncached pages of one `free` call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

NULL_PAGE = 0


class PoolExhausted(RuntimeError):
    """More pages were asked for than the free queue holds."""


class BlockPool:
    """Ref-counted pages, an LRU free queue, and `key -> (page, slot)` prefix-cache entries.

    A key names cached content (the cache managers use `(group index, unit hash)`); `slot` says
    where in the page it lies (the unit index inside an attention page; 0 for a state page).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(
                f"a pool needs at least 2 pages (page 0 is the null page): {num_pages}"
            )
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._entries: dict[Hashable, tuple[int, int]] = {}
        self._keys_of: dict[int, list[Hashable]] = {}
        self.num_evicted_pages = 0

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now (cached ones included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with ref count > 0."""
        return self.num_pages - 1 - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable pages (all but the null page) in use."""
        return self.num_used / (self.num_pages - 1)

    @property
    def num_cached_pages(self) -> int:
        """Pages (in use or free) that carry prefix-cache entries."""
        return len(self._keys_of)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        """Whether the page carries prefix-cache entries."""
        return page in self._keys_of

    def free_queue(self) -> list[int]:
        """The free pages, next to be handed out first."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages from the head of the free queue (ref count 1), evicting their cached
        entries. Raises PoolExhausted, taking nothing, when fewer than `n` are free."""
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} free")
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            self._drop_entries(page)
            self._ref[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page (the null page is skipped); a page reaching 0 goes
        back to the free queue: to the tail when cached (in the order given), else to the head,
        the uncached pages of this call in ascending id order (freeing [7, 6, 5] or [5, 6, 7]:
        the next `allocate(3)` returns [5, 6, 7])."""
        head: list[int] = []
        try:
            for page in pages:
                if page == NULL_PAGE:
                    continue
                ref = self._ref[page]
                if ref <= 0:
                    raise ValueError(f"page {page} freed more often than it was taken")
                self._ref[page] = ref - 1
                if ref == 1:
                    self._free[page] = None
                    if page not in self._keys_of:
                        head.append(page)
        finally:  # also when a page is refused: those already freed are at the head
            head.sort(reverse=True)  # the last one moved to the head ends up first
            for page in head:
                self._free.move_to_end(page, last=False)

    def touch(self, pages: Iterable[int]) -> None:
        """Take one more reference on each page (the null page is skipped); a free page leaves
        the free queue with its cached entries intact."""
        for page in pages:
            if page == NULL_PAGE:
                continue
            if self._ref[page] == 0:
                del self._free[page]
            self._ref[page] += 1

    def register(self, key: Hashable, page: int, slot: int = 0) -> bool:
        """Record that `page` (in use) holds the content named `key` at `slot`. The first page
        registered under a key keeps it: returns False, changing nothing, if the key exists."""
        if page == NULL_PAGE or self._ref[page] == 0:
            raise ValueError(f"only a page in use can be registered, not page {page}")
        if key in self._entries:
            return False
        self._entries[key] = (page, slot)
        self._keys_of.setdefault(page, []).append(key)
        return True

    def lookup(self, key: Hashable) -> tuple[int, int] | None:
        """`(page, slot)` holding the content named `key`, or None."""
        return self._entries.get(key)

    def clear_cache(self) -> bool:
        """Drop every prefix-cache entry; only when no page is in use (returns False else)."""
        if self.num_used:
            return False
        self._entries.clear()
        self._keys_of.clear()
        return True

    def _drop_entries(self, page: int) -> None:
        keys = self._keys_of.pop(page, None)
        if keys:
            for key in keys:
                del self._entries[key]
            self.num_evicted_pages += 1
