"""CacheCoordinator and its per-group managers, and the prefix lookup: exact page ids."""

from __future__ import annotations

import pytest
from core_fixtures import make_plan, make_request

from hybridserve.config import ConfigError
from hybridserve.core.block_pool import BlockPool
from hybridserve.core.cache_manager import CacheCoordinator
from hybridserve.core.prefix_cache import chain_hashes, find_prefix, prefix_unit


def compute(coord: CacheCoordinator, request, n: int, hit=None):
    """One step of `n` tokens for one request, as the scheduler drives it; returns the copies."""
    assert coord.allocate_slots(request, n, hit)
    copies = coord.take_page_copies()
    request.num_computed_tokens += n
    coord.on_computed(request)
    coord.finish_step()
    return copies


def test_pages_per_group_growth_and_all_or_nothing():
    coord = CacheCoordinator(make_plan("MA"), 12, enable_prefix_caching=False)
    a = make_request("a", range(1, 41))
    b = make_request("b", range(1, 11))
    assert coord.allocate_slots(a, 40) and coord.block_tables(a) == ((1,), (2, 3, 4))
    assert coord.allocate_slots(b, 10) and coord.block_tables(b) == ((5,), (6,))
    a.num_computed_tokens = 40
    assert coord.allocate_slots(a, 9) and coord.block_tables(a) == ((1,), (2, 3, 4, 7))
    assert coord.num_free == 4
    c = make_request("c", range(100))
    assert not coord.allocate_slots(c, 100)  # 1 + 7 pages > 4 free
    assert not coord.has_pages("c") and coord.num_free == 4
    coord.free(a)
    # uncached pages go to the head: the state page first, then attention last page first
    assert coord.pool.free_queue() == [2, 3, 4, 7, 1, 8, 9, 10, 11]
    assert coord.take_page_copies() == ()


def test_sliding_window_frees_pages_behind_the_window():
    coord = CacheCoordinator(make_plan("S", window=8), 8, enable_prefix_caching=False)
    r = make_request("r", range(60))
    assert coord.allocate_slots(r, 40) and coord.block_tables(r) == ((1, 2, 3),)
    r.num_computed_tokens = 40
    assert coord.allocate_slots(r, 1)  # pages wholly before 40 - 8 = 32 go: 0 and 1
    assert coord.block_tables(r) == ((0, 0, 3),)
    assert coord.pool.ref_count(1) == coord.pool.ref_count(2) == 0
    assert coord.pool.free_queue()[:2] == [1, 2]
    r.num_computed_tokens = 56
    assert coord.allocate_slots(r, 1)  # page 3 (tokens 32..47) leaves, and is reused at once
    assert coord.block_tables(r) == ((0, 0, 0, 3),)
    coord.free(r)
    assert coord.num_free == 7


def test_mamba_groups_hold_one_state_page_whatever_the_length():
    coord = CacheCoordinator(make_plan("MM"), 4, enable_prefix_caching=False)
    r = make_request("r", range(100))
    assert coord.allocate_slots(r, 100) and coord.block_tables(r) == ((1,), (2,))
    r.num_computed_tokens = 100
    assert coord.allocate_slots(r, 50) and coord.block_tables(r) == ((1,), (2,))
    assert coord.pages_for(10_000) == 2


def test_hit_shares_whole_pages_and_copies_the_partial_one():
    coord = CacheCoordinator(make_plan("A"), 16, unit=4)
    a = make_request("a", range(1, 42))  # 41 tokens: units 0..9 are full
    compute(coord, a, 41)
    assert coord.block_tables(a) == ((1, 2, 3),)
    b = make_request("b", list(range(1, 39)) + [99] * 5)  # shares 38 tokens = 9 full units
    hit = coord.find_prefix(b)
    assert (hit.num_tokens, hit.shared, hit.sources) == (36, ((1, 2),), (3,))
    assert coord.allocate_slots(b, 7, hit)
    assert coord.block_tables(b) == ((1, 2, 4),)
    assert b.num_computed_tokens == b.num_cached_tokens == 36
    assert [coord.pool.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 2, 1]
    assert coord.take_page_copies() == ((3, 4),)
    assert coord.transient_pages == [3]
    coord.finish_step()
    assert coord.pool.ref_count(3) == 1 and coord.transient_pages == []
    stats = coord.stats
    assert (stats.num_queries, stats.queried_tokens, stats.hit_tokens) == (2, 41 + 43, 36)


def test_copy_source_is_not_handed_out_before_its_step_ran():
    coord = CacheCoordinator(make_plan("A"), 8, unit=4)
    a = make_request("a", range(1, 42))
    compute(coord, a, 41)
    coord.free(a)
    assert all(coord.pool.is_cached(p) for p in (1, 2, 3))
    b = make_request("b", list(range(1, 39)) + [99] * 5)
    assert coord.allocate_slots(b, 7, coord.find_prefix(b))
    assert coord.take_page_copies() == ((3, 4),)
    assert 3 not in coord.pool.free_queue() and coord.pool.ref_count(3) == 1
    grabbed = coord.pool.allocate(coord.num_free)
    assert 3 not in grabbed and coord.pool.lookup((0, chain_hashes(a.all_token_ids, 4, [], 9)[8]))
    coord.pool.free(grabbed)
    coord.finish_step()
    assert coord.pool.ref_count(3) == 0 and coord.pool.free_queue()[-1] == 3


def test_eviction_drops_entries_and_shortens_the_hit():
    coord = CacheCoordinator(make_plan("A"), 8, unit=4)
    a = make_request("a", range(1, 42))
    compute(coord, a, 41)
    coord.free(a)  # cached pages join the tail last page first: 3, 2, 1
    assert coord.pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]
    b = make_request("b", range(1, 46))
    assert coord.find_prefix(b).num_tokens == 40
    coord.pool.free(coord.pool.allocate(5))  # evicts page 3 (units 8, 9)
    hit = coord.find_prefix(b)
    assert (hit.num_tokens, hit.shared, hit.sources) == (32, ((1, 2),), (None,))
    coord.pool.free(coord.pool.allocate(coord.num_free))  # evicts everything
    assert coord.find_prefix(b).num_tokens == 0 and coord.pool.num_cached_pages == 0


def test_mamba_hit_needs_a_snapshot_and_copies_it():
    coord = CacheCoordinator(make_plan("MA"), 12, unit=4)
    a = make_request("a", range(1, 42))
    assert compute(coord, a, 16) == ()
    # the next step starts at 16, a unit boundary: the running state page 1 is copied first
    assert compute(coord, a, 16) == ((1, 4),)
    assert coord.block_tables(a) == ((1,), (2, 3))
    h = chain_hashes(a.all_token_ids, 4, [], 8)
    assert coord.pool.lookup((0, h[3])) == (4, 0) and coord.pool.ref_count(4) == 0
    assert coord.stats.num_snapshots == 1
    b = make_request("b", list(range(1, 21)) + [99] * 10)  # units 0..4 match, snapshot at 3
    hit = coord.find_prefix(b)
    assert (hit.num_tokens, hit.shared, hit.sources) == (16, ((), (2,)), (4, None))
    assert coord.allocate_slots(b, 14, hit)
    assert coord.block_tables(b) == ((5,), (2, 6))
    assert coord.take_page_copies() == ((4, 5),)
    coord.finish_step()
    c = make_request("c", list(range(1, 13)) + [98] * 10)  # units 0..2 match, no snapshot
    assert coord.find_prefix(c).num_tokens == 0


def test_a_request_ending_on_a_boundary_leaves_its_state_page_as_snapshot():
    coord = CacheCoordinator(make_plan("MA"), 12, unit=4)
    a = make_request("a", range(1, 42))
    compute(coord, a, 40)
    assert coord.block_tables(a) == ((1,), (2, 3, 4))
    coord.free(a, keep_state=True)
    assert coord.stats.num_snapshots == 1 and coord.pool.is_cached(1)
    b = make_request("b", list(range(1, 41)) + [7])
    hit = coord.find_prefix(b)
    assert (hit.num_tokens, hit.shared, hit.sources) == (40, ((), (2, 3)), (1, 4))
    other = make_request("o", range(1, 42))
    compute(coord, other, 40)
    coord.free(other, keep_state=False)  # same content, but its state is not trusted
    assert coord.stats.num_snapshots == 1


def test_find_prefix_cuts_at_mixed_pages_and_missing_snapshots():
    pool = BlockPool(10)
    pool.allocate(5)
    h = chain_hashes(list(range(100)), 4, [], 12)
    for k in range(4):
        pool.register((0, h[k]), 1, k)
    pool.register((0, h[4]), 2, 0)
    pool.register((0, h[5]), 2, 1)
    pool.register((0, h[6]), 3, 2)  # unit 6 in another page than units 4 and 5
    pool.register((0, h[7]), 2, 3)
    hit = find_prefix(pool, ["full_attention"], [None], 16, 4, h)
    assert (hit.num_tokens, hit.shared, hit.sources) == (24, ((1,),), (2,))
    kinds, windows = ["full_attention", "mamba"], [None, None]
    assert find_prefix(pool, kinds, windows, 16, 4, h).num_tokens == 0  # no snapshot at all
    pool.register((1, h[4]), 4)
    hit = find_prefix(pool, kinds, windows, 16, 4, h)
    assert (hit.num_tokens, hit.shared, hit.sources) == (20, ((1,), ()), (2, 4))
    other = BlockPool(4)
    other.allocate(1)
    other.register((0, h[0]), 1, 1)  # unit 0 at slot 1: a wrong slot never matches
    assert find_prefix(other, ["full_attention"], [None], 16, 4, h).num_tokens == 0


def test_find_prefix_asks_a_sliding_window_only_for_its_window():
    pool = BlockPool(10)
    pool.allocate(5)
    h = chain_hashes(list(range(100)), 4, [], 10)
    pool.register((0, h[8]), 5, 0)
    pool.register((0, h[9]), 5, 1)
    hit = find_prefix(pool, ["sliding_window"], [8], 16, 4, h)
    # p = 40 needs tokens 32..39 = units 8, 9; pages 0 and 1 lie before the window
    assert (hit.num_tokens, hit.shared, hit.sources) == (40, ((0, 0),), (5,))
    hit = find_prefix(pool, ["sliding_window"], [12], 16, 4, h)
    assert hit.num_tokens == 0  # a window of 12 also needs unit 7


def test_prefix_unit_rule():
    assert prefix_unit(make_plan("MA", block_size=16)) == 16  # small pages: the page
    assert prefix_unit(make_plan("MA", block_size=16), 4) == 4
    with pytest.raises(ConfigError, match="prefix_unit"):
        prefix_unit(make_plan("MA", block_size=16), 5)
    # kernel block 16: 4176 = 16 x 261 = 16 x 9 x 29 -> 144; 1056 = 16 x 66 -> 16 x 11 = 176;
    # 2096 = 16 x 131 (prime) -> 16
    for block, unit in ((4176, 144), (1056, 176), (2096, 16)):
        assert prefix_unit(make_plan("MA", block_size=block, kernel_block_size=16)) == unit
