"""Build a runner (model + cache plan + regions) from a model directory."""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp

from backends.protocol import load_ops
from hybridserve.cache.plan import make_plan, num_pages_for, pages_per_request
from hybridserve.config import CacheConfig
from hybridserve.parallel import make_mesh
from hybridserve.runner.input_batch import bucket
from hybridserve.runner.memory import (
    HOST_POOL_BYTES,
    PoolSizing,
    activation_bytes,
    device_budget,
    pool_budget,
)
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.runner.packed import MAX_SEGMENT, SMALLEST_SEGMENT, PackLimits
from hybridserve.weights.loader import load_model

log = logging.getLogger(__name__)


def make_runner(
    model_dir: str,
    *,
    dtype: str | None = None,
    tp: int = 1,
    backend: str = "auto",
    cache: CacheConfig | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 8,
    max_prefill_chunk: int = 256,
    max_step_tokens: int | None = None,
    progress: bool = False,
    shareable_regions: bool = False,
    load_format: str = "auto",
    seed: int = 0,
) -> ModelRunner:
    """Load the model and allocate its cache (`shareable_regions`: see `cache.regions`;
    `load_format="dummy"`: random weights drawn from `seed`, see `weights/dummy.py`). The pool
    is sized for requests computed in chunks of at most `max_prefill_chunk` tokens (the
    engine's) and, unless the cache config fixes it, by device memory (`runner.memory`: the
    largest program computes `max_step_tokens` prompt tokens, default `max_num_seqs` whole
    chunks)."""
    cache = cache or CacheConfig()
    mesh = make_mesh(tp)
    model, cfg = load_model(model_dir, load_ops(backend), mesh, dtype, progress, load_format, seed)
    dtype_name = jnp.dtype(dtype or cfg.dtype).name
    plan = make_plan(cfg, cache, tp, dtype_name)
    kv = {g.spec.dtype for g in plan.groups if g.spec.kind in ("full_attention", "sliding_window")}
    if cfg.kv_cache_dtype is not None and kv and kv != {cfg.kv_cache_dtype}:
        log.warning(
            "%s: the checkpoint's FP8 KV cache scales go unused: the KV cache is %s "
            "(kv_cache_dtype=%r; 'auto' or 'fp8' uses them)",
            model_dir, ", ".join(sorted(kv)), cache.kv_dtype,
        )  # fmt: skip
    max_len = min(max_model_len, cfg.max_position_embeddings)
    size = functools.partial(num_pages_for, plan, cache, max_num_seqs, max_len, max_prefill_chunk)
    step_tokens = max_step_tokens or max_num_seqs * max_prefill_chunk
    segment = min(MAX_SEGMENT, bucket(max_prefill_chunk, SMALLEST_SEGMENT))
    make = functools.partial(
        ModelRunner,
        model,
        cfg,
        plan,
        mesh,
        max_model_len=max_len,
        pack_limits=PackLimits.for_steps(step_tokens, segment),
        shareable_regions=shareable_regions,
    )
    if cache.num_pages is not None or cache.memory_bytes is not None:
        return make(num_pages=size(0))
    # a pool for one request, then the device's budget with the weights in place (prepared)
    runner = make(num_pages=sum(pages_per_request(plan, max_len, max_prefill_chunk)) + 1)
    budget = device_budget(mesh, cache.gpu_memory_utilization)
    if budget is None:  # the device reports no memory (the CPU)
        runner.resize_pool(size(HOST_POOL_BYTES))
        return runner
    regions = runner.cache_bytes // plan.tensor_parallel_size  # counted in the budget's use
    activations = activation_bytes(runner, max_num_seqs, step_tokens)
    runner.resize_pool(size(pool_budget(budget, activations, regions)))
    runner.pool_sizing = PoolSizing(budget + regions, activations)
    return runner
