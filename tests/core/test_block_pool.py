"""BlockPool: exact page ids, free-queue order, ref counts and prefix-cache entries."""

from __future__ import annotations

import pytest

from hybridserve.core.block_pool import BlockPool, PoolExhausted


def test_allocate_in_id_order_and_never_the_null_page():
    pool = BlockPool(6)
    assert pool.num_free == 5 and pool.free_queue() == [1, 2, 3, 4, 5]
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_free == 0 and pool.num_used == 5 and pool.usage == 1.0
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert [pool.ref_count(p) for p in range(6)] == [0, 1, 1, 1, 1, 1]


def test_exhausted_allocation_takes_nothing():
    pool = BlockPool(4)
    with pytest.raises(PoolExhausted):
        pool.allocate(4)
    assert pool.num_free == 3 and pool.allocate(3) == [1, 2, 3]


def test_null_page_is_ignored_by_free_and_touch():
    pool = BlockPool(3)
    pool.free([0, 0])
    pool.touch([0])
    assert pool.ref_count(0) == 0 and pool.free_queue() == [1, 2]


def test_uncached_pages_return_to_the_head_cached_ones_to_the_tail():
    pool = BlockPool(6)
    pages = pool.allocate(5)
    pool.register("b", 2)
    pool.register("d", 4, slot=3)
    pool.free(pages)
    # 1, 3, 5 go to the head (ascending); 2 and 4 are appended to the tail
    assert pool.free_queue() == [1, 3, 5, 2, 4]
    assert pool.allocate(3) == [1, 3, 5]
    assert pool.lookup("b") == (2, 0) and pool.lookup("d") == (4, 3)
    assert pool.allocate(1) == [2]  # evicts page 2's entry, not page 4's
    assert pool.lookup("b") is None and pool.lookup("d") == (4, 3)
    assert pool.num_evicted_pages == 1 and not pool.is_cached(2) and pool.is_cached(4)


def test_freed_runs_come_back_ascending():
    pool = BlockPool(12)
    assert pool.allocate(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    pool.free([5, 6, 7])
    assert pool.free_queue()[:4] == [5, 6, 7, 9]
    assert pool.allocate(3) == [5, 6, 7]
    # last page first, as the cache managers free a table: the same ascending run
    pool.free(reversed([5, 6, 7]))
    assert pool.allocate(3) == [5, 6, 7]
    # one call's pages form one ascending block ahead of the pages freed before
    pool.free([8, 2])
    pool.free([7, 3, 6])
    assert pool.free_queue() == [3, 6, 7, 2, 8, 9, 10, 11]
    # a cached page in the middle goes to the tail; the others still come back in order
    pool.register("k", 5)
    pool.free([4, 5, 1])
    assert pool.free_queue() == [1, 4, 3, 6, 7, 2, 8, 9, 10, 11, 5]
    assert pool.allocate(4) == [1, 4, 3, 6]


def test_a_refused_free_keeps_the_pages_freed_before_it():
    pool = BlockPool(6)
    pool.allocate(3)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([3, 2, 4])  # page 4 was never taken
    assert pool.free_queue() == [2, 3, 4, 5] and pool.ref_count(1) == 1


def test_cached_pages_evict_least_recently_freed_first():
    pool = BlockPool(5)
    pages = pool.allocate(4)
    for page in pages:
        pool.register(f"k{page}", page)
    pool.free([3])
    pool.free([1])
    pool.free([4, 2])
    assert pool.free_queue() == [3, 1, 4, 2]
    assert pool.allocate(2) == [3, 1]
    assert [pool.lookup(f"k{p}") for p in (1, 2, 3, 4)] == [None, (2, 0), None, (4, 0)]


def test_touch_takes_a_cached_free_page_back_with_its_entries():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.register("x", 2, slot=1)
    pool.free([2])
    assert pool.free_queue() == [2] and pool.ref_count(2) == 0
    pool.touch([2])
    pool.touch([2])
    assert pool.free_queue() == [] and pool.ref_count(2) == 2 and pool.lookup("x") == (2, 1)
    pool.free([2])
    assert pool.free_queue() == [] and pool.ref_count(2) == 1
    pool.free([2])
    assert pool.free_queue() == [2] and pool.lookup("x") == (2, 1)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([2])


def test_register_keeps_the_first_page_and_needs_a_page_in_use():
    pool = BlockPool(4)
    pool.allocate(2)
    assert pool.register(("g", b"h"), 1, slot=2)
    assert not pool.register(("g", b"h"), 2, slot=0)
    assert pool.lookup(("g", b"h")) == (1, 2) and not pool.is_cached(2)
    with pytest.raises(ValueError, match="in use"):
        pool.register("free page", 3)
    with pytest.raises(ValueError, match="in use"):
        pool.register("null page", 0)


def test_clear_cache_only_when_idle():
    pool = BlockPool(3)
    (page,) = pool.allocate(1)
    pool.register("k", page)
    assert not pool.clear_cache() and pool.lookup("k") == (page, 0)
    pool.free([page])
    assert pool.clear_cache() and pool.lookup("k") is None and pool.num_cached_pages == 0
    assert pool.free_queue() == [2, 1]


def test_pool_needs_two_pages():
    with pytest.raises(ValueError, match="null page"):
        BlockPool(1)
