"""The cache pool sized by memory (`runner.memory`): from the device's budget less the largest
step program's activations (its compiled memory analysis), or from `kv_cache_memory` bytes.
The CPU reports no memory, so the device budget is stood in for by a fixed number here; the
arithmetic and the resized regions are real."""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve.cache.plan import num_pages_for, pages_per_request
from hybridserve.config import CacheConfig, ConfigError, EngineConfig
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.parallel import make_mesh
from hybridserve.runner import factory
from hybridserve.runner.memory import activation_bytes, device_budget
from hybridserve.runner.programs import dummy_batch

SETTINGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_prefill_chunk=64)


def test_the_cpu_reports_no_memory():
    assert device_budget(make_mesh(1), 0.9) is None


def test_pool_sized_by_the_budget_less_the_activations(monkeypatch):
    asked = []

    def budget(mesh, utilization):
        asked.append(utilization)
        return 3 * 2**20  # bytes beyond the weights: a pool of a few requests

    monkeypatch.setattr(factory, "device_budget", budget)
    cache = CacheConfig(gpu_memory_utilization=0.8)
    runner = factory.make_runner(str(DEFAULT_MODEL), cache=cache, **SETTINGS)
    sizing = runner.pool_sizing
    assert asked == [0.8] and sizing is not None
    # the largest program (packed rows of 256 prompt tokens) at least returns logits [4, 1, V]
    assert sizing.activation_bytes >= 4 * runner.cfg.vocab_size * 4
    plan = runner.plan
    fit = (sizing.budget_bytes - sizing.activation_bytes) // (
        plan.page_size_bytes * plan.num_regions
    )
    cap = 2 * 4 * sum(pages_per_request(plan, 256, 64)) + 1
    assert runner.num_pages == max(2, min(fit, cap)) and fit < cap  # the budget binds
    # the regions are donated: a larger pool does not count as more activations
    assert activation_bytes(runner, 4, 4 * 64) == sizing.activation_bytes  # 4 whole chunks
    rows = runner.regions[0].shape[1]
    assert rows == runner.num_pages * runner.layout.page_rows
    logits, _ = runner.run(dummy_batch(runner, 2, 16))  # the resized pool steps
    assert logits.shape[0] == 2 and np.isfinite(np.asarray(logits)).all()


def test_a_budget_too_small_for_one_request_says_what_to_change(monkeypatch):
    from hybridserve.engine import LLMEngine

    monkeypatch.setattr(factory, "device_budget", lambda mesh, utilization: 0)
    config = EngineConfig.from_kwargs(str(DEFAULT_MODEL), **SETTINGS)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLMEngine(config, progress=False)


def test_kv_cache_memory_sets_the_pool_bytes():
    config = EngineConfig.from_kwargs(str(DEFAULT_MODEL), kv_cache_memory=2**20, **SETTINGS)
    assert config.cache.memory_bytes == 2**20 and config.cache.gpu_memory_utilization == 0.9
    runner = factory.make_runner(str(DEFAULT_MODEL), cache=config.cache, **SETTINGS)
    plan = runner.plan
    fit = 2**20 // (plan.page_size_bytes * plan.num_regions)
    assert runner.num_pages == num_pages_for(plan, config.cache, 4, 256, 64, 0) == max(2, fit)
    assert runner.pool_sizing is None
    for bad in (dict(kv_cache_memory=0), dict(gpu_memory_utilization=0.0)):
        with pytest.raises(ConfigError):
            EngineConfig.from_kwargs(str(DEFAULT_MODEL), **bad)
