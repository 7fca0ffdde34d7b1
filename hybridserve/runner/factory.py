"""Build a runner (model + cache plan + regions) from a model directory."""

from __future__ import annotations

import jax.numpy as jnp

from backends.protocol import load_ops
from hybridserve.config import CacheConfig, ModelConfig
from hybridserve.kv_spec import CachePlan, layer_specs, plan_cache
from hybridserve.parallel import make_mesh
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.weights.loader import load_model


def make_plan(cfg: ModelConfig, cache: CacheConfig, tp: int, dtype: str) -> CachePlan:
    """The cache plan for `cfg` at TP `tp`; "auto" cache dtypes follow the model dtype."""
    kv = dtype if cache.kv_dtype == "auto" else cache.kv_dtype
    conv = dtype if cache.conv_dtype == "auto" else cache.conv_dtype
    specs = layer_specs(cfg, tp, kv, conv, cache.ssm_dtype, cache.conv_layout)
    return plan_cache(specs, tp, cache.kernel_block_size, cache.block_size)


def num_pages_for(
    plan: CachePlan, cache: CacheConfig, max_num_seqs: int, max_model_len: int, chunk: int = 256
) -> int:
    """Pages in the pool: `cache.num_pages` if set; otherwise as many as fit in
    `cache.memory_bytes` per rank, but no more than twice what `max_num_seqs` requests of
    `max_model_len` tokens need (the rest would only hold prefix-cache entries, and a smaller
    pool keeps every region small). Sliding-window groups need only the pages of their window
    and one step of up to `chunk` tokens."""
    if cache.num_pages is not None:
        return cache.num_pages
    full = -(-max_model_len // plan.block_size)
    per_request = sum(
        1
        if g.kind == "mamba"
        else min(full, -(-(g.spec.sliding_window + chunk) // plan.block_size) + 1)
        if g.kind == "sliding_window"
        else full
        for g in plan.groups
    )
    fit = cache.memory_bytes // (plan.page_size_bytes * plan.num_regions)
    return max(2, min(fit, 2 * max_num_seqs * per_request + 1))


def make_runner(
    model_dir: str,
    *,
    dtype: str | None = None,
    tp: int = 1,
    backend: str = "xla",
    cache: CacheConfig | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 8,
    progress: bool = False,
    shareable_regions: bool = False,
    load_format: str = "auto",
    seed: int = 0,
) -> ModelRunner:
    """Load the model and allocate its cache (`shareable_regions`: see `runner.regions`;
    `load_format="dummy"`: random weights drawn from `seed`, see `weights/dummy.py`)."""
    cache = cache or CacheConfig()
    mesh = make_mesh(tp)
    model, cfg = load_model(model_dir, load_ops(backend), mesh, dtype, progress, load_format, seed)
    dtype_name = jnp.dtype(dtype or cfg.dtype).name
    plan = make_plan(cfg, cache, tp, dtype_name)
    max_len = min(max_model_len, cfg.max_position_embeddings)
    pages = num_pages_for(plan, cache, max_num_seqs, max_len)
    return ModelRunner(model, cfg, plan, mesh, pages, max_len, shareable_regions=shareable_regions)
