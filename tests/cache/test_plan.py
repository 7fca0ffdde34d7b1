"""Pages per request: one rule (`cache.plan.pages_per_request`) for the coordinator's check and
the pool's size, taken at the engine's real prefill chunk."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from core_fixtures import make_plan  # noqa: E402

from hybridserve.cache.plan import num_pages_for, pages_per_request  # noqa: E402
from hybridserve.config import CacheConfig  # noqa: E402
from hybridserve.core.cache_manager import CacheCoordinator  # noqa: E402


def test_pages_per_request_by_kind():
    plan = make_plan("MAS", block_size=16, window=40)
    # mamba 1; full cdiv(1000, 16) = 63; window min(63, cdiv(40 + chunk, 16) + 1)
    assert pages_per_request(plan, 1000, 8) == (1, 63, 4)
    assert pages_per_request(plan, 1000, 256) == (1, 63, 20)
    assert pages_per_request(plan, 20, 256) == (1, 2, 2)  # a short request: its own pages


def test_pool_and_coordinator_agree_at_the_real_chunk():
    plan = make_plan("MAS", block_size=16, window=40)
    coord = CacheCoordinator(plan, 8)
    cache = CacheConfig(memory_bytes=1 << 40)  # memory is no limit: 2 * seqs * per_request + 1
    for chunk in (8, 64, 256, 1024):
        need = coord.pages_for(1000, chunk)
        assert need == sum(pages_per_request(plan, 1000, chunk))
        assert num_pages_for(plan, cache, 3, 1000, chunk, 0) == 2 * 3 * need + 1
    # a chunk smaller than the old fixed 256 sizes a smaller pool, still enough for one request
    assert num_pages_for(plan, cache, 1, 1000, 8, 0) < num_pages_for(plan, cache, 1, 1000, 256, 0)
    assert CacheConfig(num_pages=5).num_pages == num_pages_for(
        plan, CacheConfig(num_pages=5), 1, 1, 1, 0
    )
